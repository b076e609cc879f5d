"""The inbox maintenance: the reaper's loop over tracker.inbox.retention.maintain, and the inbox's
gauges. Several reapers may run it at once: the partitions are made under a transaction advisory
lock (the others make none) and a drop another is doing is skipped."""

from __future__ import annotations

import datetime
import threading

from psycopg_pool import ConnectionPool

from harvester import logs
from harvester.config import Config
from harvester.metrics import get as get_metrics
from harvester.publishing.deliveries import logs_safe
from tracker.inbox import retention


def policy(cfg: Config) -> retention.Retention:
    i = cfg.inbox
    return retention.Retention(retention=i.retention, bucket=i.bucket, ahead=i.ahead, max_drops=i.max_drops)


def inbox_loop(cfg: Config, pool: ConnectionPool, stop: threading.Event) -> None:
    """At once, then every `inbox.interval`: make upcoming partitions, drop expired ones, refresh
    the gauges."""
    log, m = logs.get("reaper.inbox"), get_metrics(cfg.metrics.prefix)
    keep, schema = policy(cfg), cfg.database.schema
    while True:
        try:
            with pool.connection() as conn:
                got = retention.maintain(conn, schema=schema, policy=keep)
                parts = retention.partitions(conn, schema=schema)
            m.inbox_partitions_dropped.inc(len(got.dropped))
            m.inbox_bytes.set(sum(p.bytes for p in parts))
            m.inbox_ids.set(sum(p.rows_estimate for p in parts))
            holding = [p for p in parts if p.holds_ids]
            now = datetime.datetime.now(datetime.UTC)
            m.inbox_oldest_age.set(max(0.0, (now - holding[0].lower).total_seconds()) if holding else 0)
            if got.created or got.dropped or got.skipped:
                log.info("inbox maintained", created=got.created, dropped=got.dropped, skipped=got.skipped)
        except Exception as exc:
            m.inbox_maintenance_failures.inc()
            log.warning("inbox maintenance failed", error=logs_safe(exc))
        if stop.wait(cfg.inbox.interval):
            return
