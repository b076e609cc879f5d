"""Transactional publishing (harvester.transactional_id): every produce_rows call is one Kafka transaction.

Contract: as harvester.publishing.idempotent's strategy, and moreover:
- The first use of a producer calls init_transactions(), which makes the broker fence every older
  producer of the id: a paused old leader that resumes can write nothing more (what it wrote in
  its open transaction is aborted). It runs only while leading, with a timeout bounded by what is
  left of the leadership.
- Delivered records are filed with the settler (purged) only once their transaction commits.
- The transaction is always settled before produce_rows returns: committed once every record has
  its delivery report; or aborted when a record failed, the commit failed, the leadership deadline
  passed or the records were not all acknowledged within TXN_COMMIT_TIMEOUT. An abort raises the
  remark itself before returning, so no later batch marked under the same leader id is produced
  while the aborted rows before it wait (a key would go backwards).
- The slot holds TXN_PRODUCERS producers (ids `<id>`, `<id>#1`, ...). Before its first
  transaction a leader runs init_transactions() on every one of them, so an old leader is fenced
  on all its producers before the new one writes anything. Each settled transaction (committed or
  aborted) makes the next producer of the set current; transactions never overlap.
- Only the producing thread begins, commits and aborts. A commit runs once the poll thread has
  served every report, so its internal flush has nothing to serve and it needs no lock; an abort
  serves reports, so it runs under the slot's `hold_polls()`.
- When the slot retires the producer, the open transaction is dropped (never committed; the next
  leader's init_transactions aborts it at the broker).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial

from confluent_kafka import KafkaError, KafkaException

from harvester import logs
from harvester.metrics import MetricsLike
from harvester.publishing.deliveries import DeliverySettler
from harvester.publishing.idempotent import Deadline, PlainStrategy, Valid
from harvester.publishing.ports import ProducerLike, StoreLike
from harvester.publishing.producer_slot import ProducerSlot

# Producers per unit, used in turn, one transaction each. After a commit the broker is still
# writing that transaction's markers for a few ms, and librdkafka's AddPartitionsToTxn for the next
# transaction of the same producer then gets CONCURRENT_TRANSACTIONS and is retried after a fixed
# 20 ms (not configurable; rdkafka_txnmgr.c). The next producer's id has no transaction in
# progress, so its transaction starts at once: back-to-back transactions of 40 records here, p99
# 25 ms with one producer, 8 ms with two in turn. Transactions still run one after the other, so
# the order is that of one producer. A new leader fences every id of the set before it produces.
# Lowering this number in a later version would leave the dropped ids unfenced: keep it >= 2.
TXN_PRODUCERS = 2
TXN_INIT_TIMEOUT = 30.0  # init_transactions waits for the fenced producer's transaction to be aborted
TXN_COMMIT_TIMEOUT = 30.0  # also bounds the wait for a transaction's last acknowledgements
TXN_ABORT_TIMEOUT = 10.0


# What an init_transactions failure means, by error code: the hint must name the actual cause.
_REFUSED = frozenset(
    {
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
    }
)
_NOT_READY = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.CONCURRENT_TRANSACTIONS,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
        KafkaError._ALL_BROKERS_DOWN,
    }
)


def init_failure(err: object) -> tuple[str, str]:
    """(log level, event) for an init_transactions failure `err` (a KafkaError, or anything else)."""
    code = err.code() if isinstance(err, KafkaError) else None
    if code in _REFUSED:
        return "error", "init_transactions refused: the principal needs Write and Describe on each TransactionalId"
    if code in _NOT_READY or (isinstance(err, KafkaError) and err.retriable()):
        return (
            "warning",
            "init_transactions not done yet: the transaction coordinator is loading, moving or unreachable; "
            "retried, nothing is published meanwhile",
        )
    return "error", "init_transactions failed: nothing is published until every producer of the set is initialised"


class TransactionalStrategy:
    def __init__(
        self,
        slot: ProducerSlot,
        settler: DeliverySettler,
        store: StoreLike,
        metrics: MetricsLike,
        on_failure: Callable[[str], None],
    ) -> None:
        self.slot, self.settler, self._m, self._on_failure = slot, settler, metrics, on_failure
        self._plain = PlainStrategy(slot, settler, store)  # the produce loop itself
        self._log = logs.get("reaper.publish")
        self._lock = threading.Lock()  # the open transaction's state, shared with the poll thread
        self._seq = 0  # the open (or next) transaction; bumped whenever one is settled
        self._delivered: list[tuple] = []  # reports of the open transaction, filed once it commits
        self._failed = False  # a record of the open transaction failed: it can only abort
        # The producer set being (or last) initialised, and which of its producers init_transactions()
        # ran on: the set is ready once that is all of them.
        self._inited_set: tuple[ProducerLike, ...] | None = None
        self._inited: list[ProducerLike] = []
        self._prepare_after = 0.0  # prepare() after a failed init waits until then
        self._open: ProducerLike | None = None  # the producer with an open transaction
        self.committed = self.aborted = 0  # only the producing thread writes them
        self.records_committed = 0

    @property
    def ready(self) -> bool:
        """init_transactions() ran on every producer of the current set (the old leader is fenced)."""
        producers = self.slot.producers
        return self._inited_set is producers and len(self._inited) == len(producers)

    @property
    def plain(self) -> PlainStrategy:
        return self._plain

    def produce_rows(
        self,
        rows: list[tuple],
        leader_id: uuid.UUID,
        still_valid: Valid,
        valid_until: Deadline,
    ) -> int:
        producer = self.slot.current
        # Topics that do not exist are held before the transaction begins (MissingTopics.screen).
        self._plain.missing.screen(producer, {row[1] for row in rows})
        try:
            seq = self.begin(producer, still_valid, valid_until)
        except BaseException:
            self.settler.release(len(rows))
            raise
        if seq is None:
            self.settler.release(len(rows))
            return 0
        try:
            return self._plain.write(producer, rows, leader_id, still_valid, valid_until, partial(self.report, seq))
        except BaseException:
            if self._open is producer:
                # librdkafka may already refuse every record of this transaction (an abortable
                # error): it can only be aborted, which finish() does below.
                self._failed = True
            raise
        finally:
            if self._open is producer:
                self.finish(producer, valid_until)

    def begin(self, producer: ProducerLike, still_valid: Valid, valid_until: Deadline) -> int | None:
        """Open a transaction on `producer` and return its sequence number for the delivery
        reports; None (produce nothing) when leadership or the producer is gone."""
        if not self._init_all(producer, still_valid, valid_until):
            return None
        producer.begin_transaction()
        self.slot.busy()
        with self._lock:
            self._failed = False
            self._open = producer
        return self._seq

    def prepare(self, still_valid: Valid, valid_until: Deadline) -> None:
        """Fence the previous leader now, while leading and before rows arrive (the producing
        thread calls it when it has nothing to send), so the first rows of a leadership do not wait
        for init_transactions (50 ms here, 500 ms when the broker asks for a retry)."""
        if time.monotonic() < self._prepare_after:
            return
        try:
            self._init_all(self.slot.current, still_valid, valid_until)
        except KafkaException:  # logged by _init_all; begin() tries again with the first rows
            self._prepare_after = time.monotonic() + 1.0

    def _init_all(self, producer: ProducerLike, still_valid: Valid, valid_until: Deadline) -> bool:
        """init_transactions() on every producer of the set not yet initialised: the previous leader
        is fenced on every id before anything is written. True only once ALL of the set succeeded
        (a failed or interrupted init leaves the set not ready: nothing is begun on any of it).
        False when leadership or `producer` went; raises what an init raised."""
        clock = time.monotonic
        if clock() >= valid_until() or not still_valid():
            return False
        self.slot.used = True
        producers = self.slot.producers  # the set, replaced whole by a retire
        if self._inited_set is not producers:
            self._inited_set, self._inited = producers, []
        for index, each in enumerate(producers):
            if any(p is each for p in self._inited):
                continue  # a second init on it would fail ("not valid in state Ready")
            left = min(TXN_INIT_TIMEOUT, valid_until() - clock())
            if left <= 0:
                return False
            try:
                each.init_transactions(left)
            except KafkaException as exc:
                level, event = init_failure(exc.args[0] if exc.args else exc)
                self._log.log(
                    logging.ERROR if level == "error" else logging.WARNING,
                    event,
                    transactional_id=self.slot.transactional_id(index),
                    error=str(exc),
                )
                raise
            self._inited.append(each)
            if (
                self.slot.producers is not producers
                or self.slot.current is not producer
                or clock() >= valid_until()
                or not still_valid()
            ):
                return False
        return True

    def finish(self, producer: ProducerLike, valid_until: Deadline) -> None:
        """Commit or abort the open transaction (see the module's contract)."""
        give_up = time.monotonic() + TXN_COMMIT_TIMEOUT
        # A failed transaction keeps its queued records until it is aborted: no use waiting.
        while (
            len(producer)
            and not self._failed
            and self.slot.current is producer
            and time.monotonic() < min(give_up, valid_until())
        ):
            time.sleep(0.0005)
        if self.slot.current is not producer:
            return  # retired: on_retire dropped the transaction
        if self._failed:
            why = "a record of the transaction failed"
        elif len(producer) or time.monotonic() >= valid_until():
            why = "not acknowledged within the leadership or TXN_COMMIT_TIMEOUT"
        else:
            started = time.perf_counter()
            try:
                producer.commit_transaction(TXN_COMMIT_TIMEOUT)  # nothing left to serve: no lock
            except KafkaException as exc:
                self._log.warning("transaction commit failed", error=str(exc))
                why = "commit failed"
            else:
                with self._lock:
                    done, self._delivered = self._delivered, []
                    self._seq += 1
                    self._open = None
                self.committed += 1
                self.records_committed += len(done)
                self._m.txn_duration.observe(time.perf_counter() - started)
                self.settler.file(done)
                self.slot.rotate(after=producer)
                return
        self._abort(producer, why)
        self.slot.rotate(after=producer)

    def _abort(self, producer: ProducerLike, why: str) -> None:
        self._drop()
        self.aborted += 1
        self._m.txn_aborted.inc()
        self._log.info("transaction aborted", reason=why)
        try:
            with self.slot.hold_polls():
                producer.abort_transaction(TXN_ABORT_TIMEOUT)
        except KafkaException as exc:  # fenced, fatal or timed out: replace the producer
            self._log.warning("transaction abort failed", error=str(exc))
            self.slot.broken = True
        self._on_failure(f"transaction aborted: {why}")

    def _drop(self) -> None:
        """Forget the open transaction: its delivered rows stay marked (republished after a remark)."""
        with self._lock:
            dropped, self._delivered = self._delivered, []
            self._seq += 1
            self._open = None
        if dropped:
            self.settler.release(len(dropped))

    def on_retire(self) -> None:
        self._drop()  # the new set is not ready: readiness belongs to the set it was reached for

    def report(self, seq: int, row_id: int, leader_id: uuid.UUID, err, msg) -> None:
        """Delivery report of a record written in transaction `seq`."""
        if err is None:
            self.settler.sample(msg)
            with self._lock:
                if seq == self._seq:
                    self._delivered.append((row_id, leader_id, None))
                    return
            self.settler.release(1)  # its transaction was already dropped: the row is republished
            return
        with self._lock:
            if seq == self._seq:
                self._failed = True  # finish() aborts it (and raises the remark)
        self.settler.report(row_id, leader_id, err, msg)  # reset (or quarantine), as without transactions
