"""The batch tables the reaper's hosted services (sweeper, claim settler, ackers) look after: one
per database and schema of the configuration's outboxes (the `database` section's, and each entry
of harvester.outboxes), with the outbox table their events go to. An acker runs for those that
have an ack topic (harvester.config.ack_topics).

Completion and expiry events go to the `database` section's outbox table in its own schema, and
elsewhere to the first configured outbox of that schema: batches do not record the outbox table
they were opened for, so with several outbox tables in one schema their events all go to that one
(published all the same, by that table's units). A schema without batch tables (an outbox used
only for plain messages) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg

from harvester import logs
from harvester.config import Config, units
from harvester.publishing.publisher import logs_safe
from tracker.schema import qualified


@dataclass(frozen=True)
class BatchTarget:
    dsn: str
    schema: str
    outbox_table: str


def batch_targets(cfg: Config) -> list[BatchTarget]:
    """The configuration's (database, schema) pairs, the `database` section's first."""
    db = cfg.database
    out = [BatchTarget(db.dsn, db.schema, db.outbox_table)]
    seen = {(db.dsn, db.schema)}
    for spec in units(cfg):
        if (spec.dsn, spec.schema) not in seen:
            seen.add((spec.dsn, spec.schema))
            out.append(BatchTarget(spec.dsn, spec.schema, spec.table))
    return out


def with_batch_tables(cfg: Config) -> list[BatchTarget]:
    """batch_targets whose schema has a batch table (the `database` section's always counts: its
    services report their own errors); a database that cannot be asked is kept and logged."""
    log = logs.get("reaper.services")
    targets = batch_targets(cfg)
    kept = targets[:1]
    for t in targets[1:]:
        try:
            with psycopg.connect(t.dsn, connect_timeout=10) as conn:
                row = conn.execute("SELECT to_regclass(%s)", [qualified(t.schema, "batch").as_string(conn)]).fetchone()
        except psycopg.Error as exc:
            log.warning("batch tables not checked: kept", schema=t.schema, error=logs_safe(exc))
            kept.append(t)
            continue
        if row is not None and row[0] is not None:
            kept.append(t)
        else:
            log.info("no batch tables in this outbox's schema: not swept, settled or acked", schema=t.schema)
    return kept
