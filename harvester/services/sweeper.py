"""The sweeper: the reaper's loop over the tracker's expiry (tracker.expiry).

Several reapers may sweep at once: each chunk is one short transaction that skips rows another
sweeper holds.
"""

from __future__ import annotations

import threading

from psycopg_pool import ConnectionPool

from harvester import logs
from harvester.config import Config
from harvester.metrics import get as get_metrics
from harvester.publishing.deliveries import logs_safe
from tracker import expiry


def sweep_loop(cfg: Config, pool: ConnectionPool, stop: threading.Event) -> None:
    """Every `sweeper.interval`: fold finished children into their parents, expire idle open
    batches, delete finished ones past retention."""
    log = logs.get("reaper.sweeper")
    m = get_metrics(cfg.metrics.prefix)
    s = cfg.sweeper
    while not stop.wait(s.interval):
        try:
            with pool.connection() as conn:
                result = expiry.sweep(
                    conn,
                    schema=cfg.database.schema,
                    idle_expiry=s.idle_expiry,
                    retention=s.retention,
                    chunk=s.chunk,
                    outbox_table=cfg.database.outbox_table,
                    completion_topic=cfg.harvester.default_completion_topic,
                    expiry_topic=s.expiry_topic or None,
                    metrics_prefix=cfg.metrics.prefix,
                )
            m.sweeper_last_run.set_to_current_time()
            if result.expired or result.deleted or result.completed:
                log.info("swept", expired=result.expired, deleted=result.deleted, completed=result.completed)
        except Exception as exc:
            log.warning("sweep failed", error=logs_safe(exc))
