"""The sweeper: the reaper's loop over the tracker's expiry (tracker.expiry).

Several reapers may sweep at once: each chunk is one short transaction that skips rows another
sweeper holds.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from psycopg_pool import ConnectionPool

from harvester import logs
from harvester.config import Config
from harvester.db_pool import make_pool
from harvester.metrics import get as get_metrics
from harvester.publishing.deliveries import logs_safe
from harvester.services.targets import BatchTarget
from tracker import expiry
from tracker import metrics as tracker_metrics


def sweep_loop(
    cfg: Config, pool: ConnectionPool, stop: threading.Event, targets: list[BatchTarget] | None = None
) -> None:
    """Every `sweeper.interval`, in each of `targets` (default: the `database` section's schema;
    harvester.services.targets): fold finished children into their parents, expire idle open
    batches, delete finished ones past retention. `pool` serves the `database` DSN; another DSN
    gets a one-connection pool of its own."""
    log = logs.get("reaper.sweeper")
    m = get_metrics(cfg.metrics.prefix)
    s = cfg.sweeper
    db = cfg.database
    targets = targets or [BatchTarget(db.dsn, db.schema, db.outbox_table)]
    # Each schema's expiry counter exists at 0 from the start, not from the first sweep that expires
    # something: an alert on its increase would miss that sweep (the series would appear at N).
    counted = tracker_metrics.for_registry(REGISTRY, cfg.metrics.prefix)
    for t in targets:
        counted.batches_expired.labels(t.schema)
        counted.batches_completed.labels(t.schema)
    pools: dict[str, ConnectionPool] = {}
    try:
        while not stop.wait(s.interval):
            for t in targets:
                try:
                    if t.dsn != db.dsn and t.dsn not in pools:
                        made = make_pool(t.dsn, 1, name=f"reaper-sweeper-{t.schema}", open_wait=None)
                        made.timeout = 5.0  # a database that is away must not hold up the others
                        pools[t.dsn] = made
                    with (pool if t.dsn == db.dsn else pools[t.dsn]).connection() as conn:
                        result = expiry.sweep(
                            conn,
                            schema=t.schema,
                            idle_expiry=s.idle_expiry,
                            retention=s.retention,
                            chunk=s.chunk,
                            outbox_table=t.outbox_table,
                            completion_topic=cfg.harvester.default_completion_topic,
                            expiry_topic=s.expiry_topic or None,
                            metrics_prefix=cfg.metrics.prefix,
                        )
                    m.sweeper_last_run.set_to_current_time()
                    if result.expired or result.deleted or result.completed:
                        log.info(
                            "swept",
                            schema=t.schema,
                            expired=result.expired,
                            deleted=result.deleted,
                            completed=result.completed,
                        )
                except Exception as exc:
                    log.warning("sweep failed", schema=t.schema, error=logs_safe(exc))
    finally:
        for p in pools.values():
            p.close()
