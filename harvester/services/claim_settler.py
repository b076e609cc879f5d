"""The claim settler: the reaper's loop that settles committed ack claims (tracker.settle).

Most claims settle at their own commit; a commit that found its batch row busy leaves them for the
next settle. This loop is that next settle, every `interval` seconds, in short transactions of its
own that skip busy batches, so a completion never lags the batch's last ack by much more than
`interval`. It also settles parents with finished children not folded in yet (a finishing child
never locks its parent), so a parent finishes within about `interval` of its last child.
Several reapers may run it at once.
"""

from __future__ import annotations

import threading
import time

import psycopg
import structlog

from harvester.db_liveness import with_liveness
from harvester.db_pool import needs_new_connection
from harvester.metrics import HarvesterMetrics
from harvester.metrics import get as get_metrics
from tracker.config import DEFAULT_COMPLETION_TOPIC, DEFAULT_OUTBOX_TABLE, DEFAULT_SCHEMA, TrackerConfig
from tracker.errors import InvalidValue
from tracker.pooling import configure_for_pooler
from tracker.settle import settle

log = structlog.get_logger("reaper.settler")


class ClaimSettler:
    """The reaper's settle loop: every `interval` seconds, settle every batch with committed claims
    in one short transaction that skips busy batches (they are tried again next time)."""

    def __init__(
        self,
        *,
        dsn: str,
        schema: str = DEFAULT_SCHEMA,
        outbox_table: str = DEFAULT_OUTBOX_TABLE,
        completion_topic: str = DEFAULT_COMPLETION_TOPIC,
        interval: float = 0.01,
        limit: int = 1000,
        metrics: HarvesterMetrics | None = None,
    ) -> None:
        if not isinstance(interval, (int, float)) or isinstance(interval, bool) or interval <= 0:
            raise InvalidValue("interval", interval, "must be a number of seconds > 0")
        self.dsn = dsn
        self.config = TrackerConfig(schema, outbox_table, completion_topic)
        self.interval = float(interval)
        self.limit = limit
        self.metrics = metrics if metrics is not None else get_metrics()
        self.stats = {"passes": 0, "acked": 0, "completed": 0, "busy": 0, "errors": 0}

    def run(self, stop: threading.Event) -> None:
        conn: psycopg.Connection | None = None
        c = self.config
        try:
            while not stop.is_set():
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = psycopg.connect(with_liveness(self.dsn), autocommit=True)
                        configure_for_pooler(conn)  # PgBouncer in transaction mode: no prepared statements
                    started = time.monotonic()
                    r = settle(
                        conn,
                        schema=c.schema,
                        outbox_table=c.outbox_table,
                        completion_topic=c.completion_topic,
                        limit=self.limit,
                        metrics_prefix=self.metrics.prefix,
                    )
                    self.stats["passes"] += 1
                    self.stats["acked"] += r.acked
                    self.stats["completed"] += len(r.completed)
                    self.stats["busy"] += len(r.busy)
                    if r.completed:
                        log.info("settled", acked=r.acked, completed=len(r.completed), busy=len(r.busy))
                    if r.busy:
                        self.metrics.settle_busy.inc(len(r.busy))
                    self.metrics.settler_last_run.set_to_current_time()
                    stop.wait(max(0.0, self.interval - (time.monotonic() - started)))
                except psycopg.Error as exc:
                    if conn is not None and needs_new_connection(exc):
                        conn.close()  # a read-only or departing server: the DSN picks the primary anew
                    self.stats["errors"] += 1
                    log.warning("settle failed; retrying", error=str(exc), error_type=type(exc).__name__)
                    stop.wait(max(self.interval, 1.0))
        finally:
            if conn is not None:
                conn.close()
