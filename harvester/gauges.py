"""`reaper run`'s database gauges: the backlog, oldest row and dead rows of every outbox of the
configuration (the `database` section's, or each entry of harvester.outboxes, each from its own
database), and the batch table's counts (harvester.batch_census).

The gauges are the instance-wide view the dashboards and alert rules read: backlog and dead rows
summed over the outboxes, the oldest row the oldest of any (`reaper outbox status` shows each
outbox and lane). An outbox whose database cannot be read counts with its last values and is
logged; the others are still refreshed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from psycopg import sql

from harvester import logs
from harvester.batch_census import batch_census
from harvester.config import Config, units
from harvester.db_pool import HarvestPool, make_pool
from harvester.metrics import HarvesterMetrics
from harvester.metrics import get as get_metrics
from harvester.publishing.outbox_sql import OutboxStore
from harvester.publishing.publisher import logs_safe
from tracker.schema import qualified

DEAD_COUNTED = 100_001  # the dead-rows gauge's cap: more than 100,000 shows as 100,001
GET_CONNECTION_TIMEOUT = 5.0  # seconds an outbox on another database may hold up one refresh


@dataclass
class _Outbox:
    name: str
    store: OutboxStore
    dead: sql.Composed


def _outboxes(cfg: Config, pool: HarvestPool, pools: dict[str, HarvestPool]) -> list[_Outbox]:
    """One entry per outbox table (its lanes share it), on `pool` for the `database` DSN, else on
    a one-connection pool per other DSN (made here, into `pools`, never waiting for it to open)."""
    out: list[_Outbox] = []
    for spec in units(cfg):
        if spec.lane:
            continue  # lane 0 stands for its table
        if spec.dsn != cfg.database.dsn and spec.dsn not in pools:
            made = make_pool(spec.dsn, 1, name=f"reaper-gauges-{spec.outbox}", open_wait=None)
            made.timeout = GET_CONNECTION_TIMEOUT  # a database that is away must not hold up the others
            pools[spec.dsn] = made
        p = pool if spec.dsn == cfg.database.dsn else pools[spec.dsn]
        # counted up to DEAD_COUNTED: an incident that quarantines millions must not make every refresh scan them
        dead = sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} LIMIT {}) d").format(
            qualified(spec.schema, f"{spec.table}_dead"), sql.Literal(DEAD_COUNTED)
        )
        out.append(_Outbox(spec.outbox, OutboxStore(p, spec.schema, spec.table), dead))
    return out


class OutboxGauges:
    """The instance-wide gauges, made from each outbox's latest values."""

    def __init__(self, m: HarvesterMetrics, outboxes: list[_Outbox], log) -> None:
        self.m, self.outboxes, self.log = m, outboxes, log
        self.latest: dict[str, tuple[int, float, int]] = {}  # outbox -> (backlog rows, oldest age, dead rows)

    def refresh(self) -> None:
        m = self.m
        for o in self.outboxes:
            try:
                b = o.store.backlog()
                with o.store.pool.connection() as conn:
                    dead = conn.execute(o.dead).fetchone()
                assert dead is not None  # count(*) returns one row
            except Exception as exc:
                self.log.warning("gauge refresh failed", outbox=o.name, error=logs_safe(exc))
                continue  # its last values stand
            self.latest[o.name] = (b.rows, b.oldest_age, dead[0])
        values = list(self.latest.values())
        m.backlog_rows.set(sum(v[0] for v in values))
        m.oldest_age.set(max((v[1] for v in values), default=0.0))
        m.dead_rows.set(sum(v[2] for v in values))


def _one(row: tuple | None) -> float:
    assert row is not None
    return float(row[0])


def gauges_loop(cfg: Config, pool: HarvestPool, stop: threading.Event) -> None:
    m, log = get_metrics(cfg.metrics.prefix), logs.get("reaper.gauges")
    schema = cfg.database.schema
    requeued = sql.SQL("SELECT coalesce(sum(rows), 0) FROM {} WHERE action = 'dead-requeue'").format(
        qualified(schema, "admin_log")
    )
    pools: dict[str, HarvestPool] = {}
    try:
        gauges = OutboxGauges(m, _outboxes(cfg, pool, pools), log)
        while True:
            gauges.refresh()
            try:
                with pool.connection() as conn:
                    census = batch_census(conn, schema)
                    # an aggregate without GROUP BY: one row
                    m.requeued_rows.set(_one(conn.execute(requeued).fetchone()))  # the operator's kit (migration 0008)
                m.items_pending.set(census.items_pending)
                for state, n in census.counts.items():
                    m.batches.labels(state).set(n)
            except Exception as exc:
                log.warning("gauge refresh failed", error=logs_safe(exc))
            if stop.wait(cfg.metrics.backlog_interval):
                return
    finally:
        for p in pools.values():
            p.close()
