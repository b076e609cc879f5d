"""Mark-purge/reset: the leader's publishing loop, as its two threads run it.

While NELI says this process leads, the loop marks the lowest-id rows not marked by its current
leader id (one atomic UPDATE ... RETURNING, sorted by id), hands them to the idempotent producer
in id order, and lets the publisher purge or reset them as reports arrive. The throttle bounds
records in flight. Any produce error, delivery failure, mark/purge/reset error or mark deadline
overrun raises `force_remark`: queued work is dropped, a new leader id is taken, and marking starts
again from the head, so rows published out of turn or committed late are found again. Every mark
starts from the head, never above a cursor: a row whose transaction commits late, below rows
already marked, must be found before any causally later row of its key. Remarks that repeat with
nothing settled in between back off (doubling, up to MAX_REMARK_BACKOFF). A record Kafka can never
accept is not a failure of this kind: the publisher moves its row to the dead table and goes on.

The marker thread marks batches and queues them in order; the producer thread hands them to Kafka
while the next is marked. UnitHarvester (mark_purge_reset.py) holds the state they share, starts
them and stops them; `MarkingLoop` is their work and the checks they share.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from functools import partial
from typing import Any, NamedTuple

from confluent_kafka import KafkaException

from harvester import logs
from harvester.config import HarvesterConfig, UnitSpec
from harvester.db_pool import out_of_reach
from harvester.election.db_clock import DatabaseClock
from harvester.election.lease import Lease
from harvester.metrics import MetricsLike
from harvester.publishing.outbox_sql import MarkRefused
from harvester.publishing.ownership import ClaimTableMissing, OutboxClaim, OutboxClaimed
from harvester.publishing.ports import StoreLike
from harvester.publishing.publisher import Publisher, QuarantineError, logs_safe
from harvester.publishing.table_shape import OutboxShapeRefused
from harvester.upkeep import Upkeep
from tracker import message_ids

SHAPE_RETRY = 5.0  # seconds between checks of a table whose columns cannot be published
CLAIM_RETRY = 1.0  # seconds between holds while another layout holds the table (harvester.publishing.ownership)
SLOW_MARK = 1.0  # seconds: a mark this slow has the lane index checked (see _mark_trouble)
MIN_REMARK_BACKOFF = 0.05  # seconds before the second remark in a row without progress
MAX_REMARK_BACKOFF = 5.0  # bound of the doubling back-off


class MarkedBatch(NamedTuple):
    """Rows marked by one mark, waiting in the queue for the producing thread."""

    leader_id: uuid.UUID  # the id they were marked with
    rows: list[tuple]  # as OutboxStore.mark returns them
    started: float  # time.monotonic() when the mark started (the slow-mark check)


class MarkingLoop:
    """The marker (`_run`) and the producer (`_produce`) of one harvest unit, and a remark
    (`force_remark`): queued work dropped, marking again from the head under a new id. The state
    below is UnitHarvester's (mark_purge_reset.py), made by its __init__ and start()."""

    h: HarvesterConfig
    m: MetricsLike
    spec: UnitSpec
    log: Any
    publisher: Publisher | None
    store: StoreLike | None
    neli: Lease | None  # the unit's lease (leader_id, valid_until, state)
    claim: OutboxClaim | None
    upkeep: Upkeep | None
    _db_clock: DatabaseClock | None
    _remark: threading.Event
    _remark_why: str
    _stop: threading.Event
    _me: uuid.UUID | None  # id rows are marked with now
    _neli_id: uuid.UUID | None  # the NELI acquisition it derives from
    _adopted: uuid.UUID | None  # the last NELI acquisition whose own id marked rows (never twice)
    _thread: threading.Thread  # the marker's
    _batches: queue.Queue[MarkedBatch]  # marked, waiting for the producer thread
    remark_backoff: float
    shape_refusals: logs.Repeats  # the table's columns refused: logged when new, then every 30 s
    error: BaseException | None

    # ------------------------------------------------------------------ force remark

    def force_remark(self, why: str) -> None:
        if not self._remark.is_set():
            self._remark_why = why
            self._remark.set()

    def _skipped(self, me: uuid.UUID, why: str) -> None:
        """Rows marked by `me` were not handed to Kafka. They stay marked by `me`, which the next
        marks pass over, so if `me` is still the marking id no later batch may go out under it: a
        later row of their keys would overtake them (and they would wait for the next id)."""
        if self._me == me:
            self.force_remark(why)

    def _mark_trouble(self) -> None:
        if self.upkeep is not None:
            self.upkeep.mark_trouble()

    def _valid(self, me: uuid.UUID) -> bool:
        assert self.neli is not None  # start() sets it before the threads that call this run
        return (
            self._me == me
            and not self._remark.is_set()
            and self.neli.leader_id() == self._neli_id
            and not self._stop.is_set()
        )

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # a bug: the process must not keep a dead harvester
            self.error = exc
            self.log.exception("harvester loop crashed")
            raise

    def _run(self) -> None:
        """The marker: takes leadership changes and remarks, marks batches and queues them in order."""
        h, m, pub = self.h, self.m, self.publisher
        assert pub is not None and self.store is not None and self.neli is not None  # start() set them first
        db_clock, claim = self._db_clock, self.claim
        assert db_clock is not None and claim is not None  # likewise
        backoff, progress_at_remark = 0.0, -1
        # The message-id namespace of the rows marked (tracker.message_ids), read from the database the
        # marks go to once per leadership and again after any failed mark (the DSN may lead elsewhere).
        ids: message_ids.Namespace | None = None
        while not self._stop.is_set():
            neli_id = self.neli.leader_id()
            if neli_id is None:
                if self._me is not None:
                    self.log.info("not leading: marking stopped")
                    self._me = self._neli_id = None
                    logs.unit_leaders.set(self.spec.name, None)
                self._stop.wait(0.02)
                continue
            if neli_id != self._neli_id:
                # An acquisition marks first with its own id (fresh and random: the one the election's
                # and the publishing state's lines name), and a fresh id on every re-entry of the same
                # acquisition (a lapse that ended before the fence): rows of the lapse that were dropped
                # unsent are still marked by the old id, and only a new id marks them again, from the head.
                # Set before clearing the flag: queued batches go stale first.
                self._me = neli_id if neli_id != self._adopted else uuid.uuid4()
                self._neli_id = self._adopted = neli_id
                ids = None
                self._remark.clear()
                logs.unit_leaders.set(self.spec.name, self._me, self.spec.index, acquisition=neli_id)
                self.log.info("leading: marking from the head")
            elif self._remark.is_set():
                self._me = uuid.uuid4()
                self._remark.clear()
                logs.unit_leaders.set(self.spec.name, self._me, self.spec.index, acquisition=neli_id)
                m.force_remarks.inc()
                # Remarks that repeat with nothing settled in between (a record that fails every
                # time, Kafka refusing a topic) back off, doubling up to MAX_REMARK_BACKOFF.
                progress = pub.progress
                backoff = (
                    min(MAX_REMARK_BACKOFF, max(MIN_REMARK_BACKOFF, backoff * 2))
                    if progress == progress_at_remark
                    else 0.0
                )
                progress_at_remark = progress
                self.remark_backoff = backoff
                self.log.info("force remark", reason=self._remark_why, backoff_s=round(backoff, 3))
                if backoff:
                    self._stop.wait(backoff)
                    continue  # leadership may have changed meanwhile
            if pub.broken:  # a fatal producer error: nothing more can go through that producer
                pub.replace_if_broken()
            me = self._me
            assert me is not None  # set together with _neli_id, which equals neli_id (not None) here
            room = h.max_in_flight - pub.in_flight
            if room <= 0:
                pub.wait_below(h.max_in_flight, 0.05)
                continue
            limit = min(h.mark_batch, room)
            # Read before the check below, so a pause after the check cannot stretch it: the server
            # refuses the mark if it arrives, or finishes, after this (see OutboxStore.mark).
            until = self.neli.valid_until()
            rows, started, trouble = [], 0.0, None
            with self.neli.marking() as neli_now:  # a revocation waits for this mark to return
                if neli_now is None or not self._valid(me):
                    continue
                self.neli.database.attempt()  # unanswered for long: the election steps down
                try:
                    deadline = db_clock.at(until)
                    claim.hold(deadline, db_clock.generation)  # no other configuration marks before `deadline`
                    if ids is None:
                        ids = self.store.namespace()
                    started = time.monotonic()
                    # Always from the head (see OutboxStore.mark): rows committed late are found by
                    # the very next mark, before any causally later row of their key.
                    rows = self.store.mark(me, limit, until=deadline, ids=ids)
                except Exception as exc:
                    trouble = exc
            if trouble is None or not out_of_reach(trouble):
                self.neli.database.answered()
            else:
                self.neli.database.failed()
            if trouble is not None:
                ids = None
            if isinstance(trouble, (OutboxClaimed, ClaimTableMissing)):
                claim.report_refusal(trouble, self.log, m.claim_refusals)
                self._stop.wait(CLAIM_RETRY)
                continue
            if isinstance(trouble, OutboxShapeRefused):  # until the table is altered: checked again each turn
                if self.shape_refusals.due(str(trouble)):
                    self.log.error("not marking: the outbox table's columns cannot be published", error=str(trouble))
                self._stop.wait(SHAPE_RETRY)
                continue
            if isinstance(trouble, MarkRefused):
                # Nothing was marked. Usually the lease ended while the mark was on its way (the
                # next turn sees it); if it repeats while leading, the clocks are in question.
                db_clock.forget()
                claim.forget()
                self._mark_trouble()
                m.marks_refused.inc()
                self.log.info(
                    "mark refused: it reached or finished in the database after the lease", error=str(trouble)
                )
                self._stop.wait(0.05)
                continue
            if trouble is not None:
                db_clock.forget()
                claim.forget()
                self._mark_trouble()
                self.log.warning("mark failed", error=logs_safe(trouble))
                self.force_remark("mark failed")
                self._stop.wait(0.2)
                continue
            took = time.monotonic() - started
            m.mark_duration.observe(took)
            if took > SLOW_MARK:
                self._mark_trouble()
            if not rows:
                self._stop.wait(h.idle_poll_interval)
                continue
            m.marked.inc(len(rows))
            if self._stop.is_set():
                # Marked after the stop: left marked for the next leader (whose new id marks them
                # again), not queued, so the drain never waits for rows nothing will produce.
                self.log.info("stopping: a batch marked meanwhile is left for the next leader", rows=len(rows))
                continue
            pub.reserve(len(rows))  # marked rows count as in flight until settled or dropped
            while True:
                try:
                    self._batches.put(MarkedBatch(me, rows, started), timeout=0.05)
                    break
                except queue.Full:
                    if self._stop.is_set() or not self._valid(me):
                        pub.release(len(rows))
                        self._skipped(me, "marked rows dropped unqueued")
                        break

    def _produce_loop(self) -> None:
        try:
            self._produce()
        except BaseException as exc:
            self.error = exc
            self.log.exception("harvester producer loop crashed")
            raise

    def _produce(self) -> None:
        """The producer side of the pipeline: hands queued batches to Kafka while the next is marked."""
        h, m, pub = self.h, self.m, self.publisher
        assert pub is not None and self.neli is not None  # start() set them first
        carry = None  # a batch taken while gathering that belongs to a newer id
        # Ends only after the marker has: a batch it queued after the stop is released here
        # (see _valid), never left reserved with no thread to take it.
        while not (self._stop.is_set() and not self._thread.is_alive() and self._batches.empty() and carry is None):
            if carry is not None:
                (me, rows, started), carry = carry, None
            else:
                try:
                    me, rows, started = self._batches.get(timeout=0.05)
                except queue.Empty:
                    leader = self._me
                    if leader is not None and self._valid(leader):
                        pub.prepare(partial(self._valid, leader), self.neli.valid_until)
                    continue
            # Batches marked meanwhile go out with this one, in mark order: with transactions each
            # produce_rows call is one transaction, and rows would otherwise wait one commit per
            # batch queued ahead of them.
            while carry is None:
                try:
                    more = self._batches.get_nowait()
                except queue.Empty:
                    break
                if more.leader_id == me:
                    rows = rows + more.rows
                else:
                    carry = more
            if not self._valid(me):  # dropped: stale id, remark pending, lapsed, fenced or stopping
                pub.release(len(rows))
                self._skipped(me, "marked rows dropped unsent")
                continue
            try:
                sent = pub.produce_rows(rows, me, partial(self._valid, me), self.neli.valid_until)
            except (BufferError, KafkaException, QuarantineError) as exc:
                m.produce_errors.inc()
                self.log.warning("produce failed", error=str(exc))
                self.force_remark("produce failed")
            else:
                if sent < len(rows):
                    self._skipped(me, "marked rows left unsent")
            if time.monotonic() - started > h.mark_deadline:
                self.log.warning(
                    "mark cycle overran its deadline",
                    seconds=round(time.monotonic() - started, 3),
                    mark_deadline=h.mark_deadline,
                )
                self.force_remark("mark deadline exceeded")
