"""`UnitHarvester`: one harvest unit's publishing, started, following its lease, drained and closed.

The loop it runs while its lease says this process leads (mark, produce, purge or reset, remark)
is described and written in marking.py (`MarkingLoop`), on two threads this class starts and stops.

The leader also owns vacuuming the outbox (see `Upkeep`): deleted rows at the head of the table
otherwise slow every mark down as they pile up.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from functools import partial

import structlog
from psycopg_pool import ConnectionPool

from harvester import logs
from harvester.config import Config, UnitSpec
from harvester.config_outboxes import reserved_topics
from harvester.election.db_clock import DatabaseClock
from harvester.election.lease import LEADER, Lease
from harvester.election.timeouts import silent_broker_wait_ms
from harvester.lane_index import LaneIndexKeeper
from harvester.metrics import MetricsLike
from harvester.metrics import get as get_metrics
from harvester.publishing.marking import (  # noqa: F401  (the loop's constants: importers use them from here)
    CLAIM_RETRY,
    MAX_REMARK_BACKOFF,
    MIN_REMARK_BACKOFF,
    SLOW_MARK,
    MarkedBatch,
    MarkingLoop,
)
from harvester.publishing.outbox_sql import OutboxStore, make_pool
from harvester.publishing.ownership import OutboxClaim, holder_name, layout_of
from harvester.publishing.ports import DEFAULT, Providers, StoreLike
from harvester.publishing.publisher import Lifecycle, Publisher, producer_config
from harvester.upkeep import Upkeep


class UnitHarvester(MarkingLoop):
    """Mark-purge/reset of one harvest unit (one outbox table, or one lane of it), while its lease
    says this process leads it. Each unit has its own pool, publisher (producer, transactional id)
    and threads: one unit's stall (a dead database, a refused record) holds up no other."""

    def __init__(
        self,
        cfg: Config,
        spec: UnitSpec,
        *,
        providers: Providers = DEFAULT,
        metrics: MetricsLike | None = None,
        transactional_id: str = "",
    ) -> None:
        self.cfg, self.spec = cfg, spec
        h = cfg.harvester
        self.m: MetricsLike = metrics or get_metrics(cfg.metrics.prefix)
        self.log = logs.get("reaper.harvester").bind(unit=spec.name)
        self._txn_id = transactional_id
        self.providers = providers
        self._life = Lifecycle("harvester")
        self._led = False  # NELI made this process leader at least once
        self.pool: ConnectionPool | None = None  # made by start(), closed by close()
        self.store: StoreLike | None = None
        self._db_clock: DatabaseClock | None = None  # the leadership deadline on the server's clock
        self.claim: OutboxClaim | None = None  # this unit's layout holds its table before it marks
        self.publisher: Publisher | None = None
        self.neli: Lease | None = None  # this unit's lease (leader_id, valid_until, state)
        self._remark = threading.Event()
        self._remark_why = ""
        self._stop = threading.Event()
        self._me: uuid.UUID | None = None  # id rows are marked with now
        self._neli_id: uuid.UUID | None = None  # the NELI acquisition it derives from
        self._adopted: uuid.UUID | None = None  # the last acquisition whose own id marked rows
        with self._context():
            self._thread = logs.unit_thread(self._loop, "reaper-mark")
            self._producer_thread = logs.unit_thread(self._produce_loop, "reaper-produce")
        self._batches: queue.Queue[MarkedBatch] = queue.Queue(maxsize=2)  # marked, waiting for the producer thread
        self.upkeep: Upkeep | None = None  # the leader's vacuum and the lane index
        self.shape_refusals = logs.Repeats(30.0)  # the table's columns refused (harvester.publishing.table_shape)
        self.remark_backoff = 0.0  # the last back-off taken before a remark (0: progress was made)
        self.error: BaseException | None = None
        self.h = h

    # ------------------------------------------------------------------ lifecycle

    def _context(self):
        """This unit's name bound for the structlog lines of every thread made meanwhile (logs.unit_thread)."""
        return structlog.contextvars.bound_contextvars(unit=self.spec.name)

    def start(self, lease: Lease, kafka_cluster: str = "") -> UnitHarvester:
        """Start once, following `lease` (not yet started: NELI starts once every unit is ready) of
        the election on `kafka_cluster` (its id); a stopped unit cannot be started again (LifecycleError)."""
        with self._context():
            return self._start(lease, kafka_cluster)

    def _start(self, lease: Lease, kafka_cluster: str) -> UnitHarvester:
        self._life.start()
        logs.unit_leaders.set(self.spec.name, None, self.spec.index)
        cfg, h, spec = self.cfg, self.h, self.spec
        # Opened without waiting: a unit whose database is down (or hangs) at start holds up no other
        # unit. A connection is waited for no longer than a lease lasts (a mark past it is refused
        # anyway), so a mark, a revocation or a stop waits no longer on such a database either.
        self.pool = make_pool(
            spec.dsn,
            cfg.database.pool_size,
            name=f"reaper-harvester-{spec.name}",
            open_wait=None,
            timeout=h.heartbeat_timeout,
        )
        store = OutboxStore(self.pool, spec.schema, spec.table, lane=spec.lane, lanes=spec.lanes)
        self.store = self.providers.store(store)
        self._db_clock = DatabaseClock(self.store.database_now)
        layout = layout_of(
            kafka_cluster, h.leader_group, h.leader_topic, spec.outbox, spec.index - spec.lane, spec.lanes
        )
        self.claim = claim = OutboxClaim(self.pool, spec.schema, spec.table, layout, holder_name(spec.name))
        wait = silent_broker_wait_ms(h.heartbeat_timeout, h.session_timeout)
        conf = producer_config(cfg.kafka.bootstrap_servers, cfg.kafka.client, cfg.kafka.producer, self._txn_id, wait)
        self.publisher = Publisher(
            conf,
            self.store,
            self.m,
            purge_batch=h.purge_batch,
            purge_workers=h.purge_workers,
            providers=self.providers,
            on_failure=self.force_remark,
            reserved_topics=reserved_topics(cfg),
        ).start()
        self.publisher.queue_full_patience = h.mark_deadline / 2
        if h.trace_spans:  # a PRODUCER span per row, linked to the context stored with it (tracker.tracing)
            from opentelemetry import trace

            from tracker.tracing import producer_span

            self.publisher._plain.trace = partial(producer_span, trace.get_tracer("outbox-reaper.harvester"))
        publisher = self.publisher
        purged = lambda: publisher.purged_rows  # noqa: E731
        self.upkeep = Upkeep(h, spec, self.store, store, purged, lambda: self.leading, self._stop, self.log, claim)
        self.neli = lease
        lease.on_change = self._on_neli
        self._thread.start()
        self._producer_thread.start()
        self.upkeep.start()
        return self

    def begin_stop(self) -> None:
        """Stop marking (every unit at once, before each drains in turn)."""
        self._stop.set()

    def finish(self, drain_timeout: float | None = None, hurry: threading.Event | None = None) -> bool:
        """Stop marking and let in-flight records settle (up to drain_timeout; `hurry` set: no
        longer). False when records were still in flight at the deadline, or the wait was cut short
        by `hurry` (republished by the next leader: duplicates, never loss). The owner then leaves
        the group and calls close(). Safe on a unit whose start() failed part way."""
        timeout = self.h.drain_timeout if drain_timeout is None else drain_timeout
        if not self._life.stop():
            return True  # never started, or stopped already
        self._stop.set()
        deadline = time.monotonic() + timeout + 10
        for t in (self._thread, self._producer_thread):
            _join(t, deadline, hurry)
        if hurry is not None and hurry.is_set() and (self._thread.is_alive() or self._producer_thread.is_alive()):
            return self._cut_short()
        self._release_unproduced()
        drained = True
        if self.publisher is not None:
            drained = self._drain(max(0.1, timeout), hurry)
            if hurry is not None and hurry.is_set() and not drained:
                return self._cut_short()
            if not drained:
                self.log.warning(
                    "drain timeout: records still in flight are left for the next leader",
                    in_flight=self.publisher.in_flight,
                )
        return drained

    def _drain(self, timeout: float, hurry: threading.Event | None) -> bool:
        assert self.publisher is not None
        if hurry is None:
            return self.publisher.drain(timeout)
        deadline = time.monotonic() + timeout
        while not hurry.is_set():
            left = deadline - time.monotonic()
            if self.publisher.drain(max(0.0, min(0.1, left))):
                return True
            if left <= 0:
                return False
        return self.publisher.in_flight == 0

    def _cut_short(self) -> bool:
        """The drain was given up at once (a second signal): nothing more is waited for. False
        when records were still in flight."""
        self._release_unproduced()
        in_flight = self.publisher.in_flight if self.publisher is not None else 0
        if in_flight:
            self.log.warning(
                "stopping without waiting for the drain: records still in flight are left for the next leader",
                in_flight=in_flight,
            )
        return in_flight == 0

    def _release_unproduced(self) -> None:
        """Batches still queued once both threads ended (a thread that outlived its join): released,
        left marked for the next leader, so only records handed to Kafka count as in flight."""
        while True:
            try:
                batch = self._batches.get_nowait()
            except queue.Empty:
                return
            if self.publisher is not None:
                self.publisher.release(len(batch.rows))

    def close(self) -> None:
        """Close what start() made (safe on a unit whose start() failed part way, or never ran)."""
        self._stop.set()
        if self.publisher is not None:
            self.publisher.close()
        if self.upkeep is not None:
            self.upkeep.join(5)
        if self.pool is not None:
            # Its workers may be connecting to a database that does not answer: not waited for long
            # (daemon threads, they end with their connect attempt).
            self.pool.close(timeout=1.0)
        logs.unit_leaders.forget(self.spec.name)

    @property
    def vacuums(self) -> int:
        return self.upkeep.vacuums if self.upkeep is not None else 0

    @property
    def lane_index(self) -> LaneIndexKeeper | None:
        return self.upkeep.lane_index if self.upkeep is not None else None

    @property
    def leading(self) -> bool:
        return self.neli is not None and self.neli.leader_id() is not None

    @property
    def current_id(self) -> uuid.UUID | None:
        return self._me

    # ------------------------------------------------------------------ following the lease

    def _on_neli(self, state: str, leader_id: uuid.UUID | None) -> None:
        if self.publisher is None:
            return
        if state != LEADER and self.claim is not None:
            self.claim.forget()  # `holding` speaks for this leadership only
        if state == LEADER:
            self._led = True
        elif not self._led:
            return  # a reaper that never led has nothing to retire and nothing to report
        else:
            # Fenced or revoked: nothing of this leadership may leave the process later, not even
            # a retry of a record already sent (message.timeout.ms=0 would retry it for ever). A
            # producer that never got a record is kept (nothing to drop).
            self.publisher.retire_producer(f"neli {state}", routine=True)  # the election logged why
        self.log.info(
            "publishing state",
            state=state,
            # a new leadership marks first with the acquisition's own id (MarkingLoop), which its
            # marker may not have taken up yet; otherwise the unit's id now (logs.unit_leaders)
            **({"leader_id": str(leader_id)} if state == LEADER and leader_id is not None else {}),
            records_produced=self.publisher.produced,
            records_delivered=self.publisher.delivered,
            records_in_flight=self.publisher.in_flight,
        )


def _join(thread: threading.Thread, deadline: float, hurry: threading.Event | None) -> None:
    """Wait for `thread` until `deadline` (time.monotonic()) or `hurry`; one never started is not waited for."""
    if thread.ident is None:
        return
    while thread.is_alive() and not (hurry is not None and hurry.is_set()):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        thread.join(min(0.1, left))
