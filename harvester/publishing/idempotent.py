"""Plain publishing: marked rows go to the idempotent producer in id order, no Kafka transaction.

Contract of a publishing strategy (this one and harvester.publishing.transactional):
- `produce_rows(rows, leader_id, still_valid, valid_until)` hands rows (as OutboxStore.mark
  returns them, each with its message id built by the mark in the table's namespace)
  to the slot's current producer in the order given, and returns how many it got through (handed
  over, quarantined, or held back behind their topic's first row when the topic does not exist:
  harvester.publishing.missing_topics); fewer than given means it stopped early, and the caller must not publish
  later rows under the same leader id (the rest stay marked by it). It stops before the first row
  once the leadership deadline `valid_until()` has passed or `still_valid()` is false (checked
  every 256 rows), or when the producer was retired meanwhile. Rows not handed over are released
  from the throttle's count (they stay marked by an old id and the next mark finds them).
- A local produce error for a passing reason (`transient`) is tried again in place, up to
  PRODUCE_RETRIES times; one that persists, or is fatal, is raised (the caller forces a remark),
  except for a record Kafka can never accept (PERMANENT_PRODUCE): its row is quarantined at once and the rest go on. If that
  quarantine fails, QuarantineError is raised, so nothing of its key overtakes it. So is a row that
  cannot be produced as written (harvester.publishing.unfit_rows: header arrays not flat, a NULL
  header name, a kafka_partition that is no partition number), or whose arguments produce()
  refuses (TypeError, ValueError, OverflowError: about that record alone). An unknown
  partition that reaper computed (harvester.publishing.runs) is a stale count, not such a record:
  raised, the count looked up again.
- `on_retire()` is called by the slot when it swaps producers.

Ordering rests on the producer settings in config.REQUIRED_PRODUCER (idempotence, no message
timeout, gapless guarantee): within a partition a record is never written after an earlier one
failed, so a remark from the head of the outbox restores per-key order without a per-key barrier.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from functools import partial

from confluent_kafka import KafkaError, KafkaException

from harvester.publishing.deliveries import DeliverySettler, error_reason, invalid_topic, logs_safe
from harvester.publishing.missing_topics import MissingTopics
from harvester.publishing.ports import ProducerLike, StoreLike
from harvester.publishing.producer_slot import ProducerSlot
from harvester.publishing.runs import PartitionCounts, computes_partitions, forget_expired, plan_runs
from harvester.publishing.unfit_rows import unfit_reason, unfit_rows
from tracker.message_ids import MESSAGE_ID_HEADER

# produce() refusals that are about the record itself and can never succeed, however often retried:
# larger than message.max.bytes, an explicit partition the topic does not have, an invalid argument
# or topic name.
PERMANENT_PRODUCE = frozenset(
    {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError._UNKNOWN_PARTITION, KafkaError._INVALID_ARG, KafkaError.TOPIC_EXCEPTION}
)

# A row naming a topic the reaper reads itself (an ack topic, the acks' dead-letter topic, the
# leader topic): published with the reaper's credentials, it could ack any batch's items or disturb
# the election. Quarantined like a topic name Kafka refuses.
RESERVED = KafkaError(
    KafkaError.TOPIC_EXCEPTION,
    "a topic the reaper reads itself (acks, their dead letters, leadership): no outbox row may name it",
)
# A row naming one of Kafka's internal topics (tracker's check refuses them; a row written past it):
# the broker refuses every producer's records there, and under the gap-less guarantee fails the
# producer. Quarantined before it is produced.
INTERNAL = KafkaError(KafkaError.TOPIC_EXCEPTION, "one of Kafka's internal topics, which producers may not write")

PRODUCE_RETRIES = 3  # a record refused by produce() for a passing reason is tried again this often


def transient(failed: Exception) -> bool:
    """A produce() refusal that may pass if the same record is produced again: a KafkaError that
    is neither about the record (PERMANENT_PRODUCE) nor fatal for the producer."""
    if not isinstance(failed, KafkaException) or not failed.args or not isinstance(failed.args[0], KafkaError):
        return False
    err = failed.args[0]
    return err.code() not in PERMANENT_PRODUCE and err.code() != KafkaError._FATAL and not err.fatal()


VALID_EVERY = 256  # rows between two checks of still_valid() (and refreshes of the deadline)
SWAP_HOLD = 64  # rows produced under one hold of the slot's swap lock

Valid = Callable[[], bool]
Deadline = Callable[[], float]


class QuarantineError(RuntimeError):
    """A row that Kafka refused for good could not be moved to the dead table (database error or
    the row is no longer marked by this leader id): stop producing and remark."""

    def __init__(self, row_id: int, reason: str, detail: str) -> None:
        self.row_id, self.reason = row_id, reason
        super().__init__(f"outbox row {row_id} ({reason}) was not quarantined: {detail}")


class PlainStrategy:
    def __init__(self, slot: ProducerSlot, settler: DeliverySettler, store: StoreLike) -> None:
        self.slot, self.settler, self._store = slot, settler, store
        self.produced = 0  # records handed to a producer (only the producing thread writes it)
        self.queue_full_waits = 0  # produce() found the local queue full and waited (same thread)
        self.queue_full_patience = 1.0
        # harvester.trace_spans: called with (topic, header keys, header values) per produced row
        self.trace: Callable[[str, list, list], None] | None = None
        # One delivery report per partition run (harvester.publishing.runs) when partitions can be
        # computed; the transactional strategy calls write() with a report per record.
        self.by_runs = computes_partitions(slot._conf)
        self._counts = PartitionCounts()
        # Topics produce() refused as unknown: their rows are held back, in order, while other
        # topics' rows go on (harvester.publishing.missing_topics).
        self.missing = MissingTopics()
        settler.missing_topic = self.missing.hold

    def on_retire(self) -> None:
        pass

    def recheck_missing(self, producer: ProducerLike) -> None:
        """Ask about the held topics that are due (harvester.publishing.missing_topics); one that
        exists now has its rows marked again from the head, under a new leader id."""
        if self.missing.held:
            now_there = self.missing.recheck(producer)
            if now_there is not None:
                self.settler.remark(f"topic {now_there!r} exists now: its held rows are marked again")

    def produce_rows(
        self,
        rows: list[tuple],
        leader_id: uuid.UUID,
        still_valid: Valid,
        valid_until: Deadline,
    ) -> int:
        # A report per partition run (harvester.publishing.runs), else per record: a delivered record
        # is purged without waiting for records of other partitions (one stuck on another partition
        # would hold it, and a later record of its key could be purged first: after a remark the
        # earlier one would be published last).
        return self.write(
            self.slot.current, rows, leader_id, still_valid, valid_until, self.settler.report, self.by_runs
        )

    def write(
        self,
        producer: ProducerLike,
        rows: list[tuple],
        leader_id: uuid.UUID,
        still_valid: Valid,
        valid_until: Deadline,
        report: Callable,
        by_runs: bool = False,
    ) -> int:
        """The produce loop shared by both strategies; `report` is the per-record callback
        (called as report(row_id, leader_id, err, msg)). With `by_runs`, the rows whose partition
        is known are reported by run instead (settler.report_run; harvester.publishing.runs).
        Releases what it did not hand over, and what was handed over but no report will cover
        (a run whose last record was not produced), raising a remark for those.
        Every record gets the rows' own headers, then its `message-id` (the row's last field: the
        mark built it, tracker.message_ids.MESSAGE_ID_SQL). Returns the rows got through: handed
        over or quarantined."""
        slot, clock, swap, trace, mid = self.slot, time.monotonic, self.slot._swap, self.trace, MESSAGE_ID_HEADER
        n, i, check_at = len(rows), 0, 0  # rows[:i] are handed over, quarantined or held
        quarantined = 0  # of rows[:i], moved aside instead of handed over
        held = 0  # of rows[:i], of a topic that does not exist: not handed over, left marked
        missing = self.missing
        missing.for_leader(leader_id)
        self.recheck_missing(producer)
        holding = missing.held  # (the dict itself: a refusal below adds to it)
        slot.used = True
        # Rows that cannot be produced as written (harvester.publishing.unfit_rows): moved aside when
        # their turn comes, in no partition run. Usually none: the produce loop then never looks.
        unfit = unfit_rows(rows)
        unfit_left = sorted(unfit, reverse=True)  # their indexes, the next one last
        next_unfit = unfit_left.pop() if unfit_left else n
        if by_runs:
            single = self.settler.single
            if single:
                forget_expired(single, clock())
            parts, runs, last = plan_runs(rows, self._counts, producer, single, unfit)
            run_report = self.settler.report_run
        else:
            parts, runs, last = [], [], []
        pending: dict[int, list[int]] = {}  # run -> ids produced without a report of their own
        try:
            deadline = valid_until()
            while i < n:
                if i >= check_at:
                    if not still_valid():
                        break
                    deadline, check_at = valid_until(), i + VALID_EVERY
                if i == next_unfit:
                    self._quarantine_now(leader_id, rows[i][0], unfit[i])
                    quarantined += 1
                    i += 1
                    next_unfit = unfit_left.pop() if unfit_left else n
                    continue
                end = min(n, i + SWAP_HOLD, check_at, next_unfit)
                expired = False
                failed: BufferError | KafkaException | None = None
                refused: Exception | None = None  # produce() refused rows[i]'s arguments
                # Inlined ProducerSlot.send, the swap lock held for a few records at a time (a lock
                # and a method call per record cost): a retired producer gets not one more record.
                with swap:
                    if slot.current is not producer:
                        break  # retired (fence, revocation)
                    produce = producer.produce
                    try:
                        while i < end:
                            if clock() >= deadline:
                                expired = True
                                break
                            row_id, topic, key, value, hkeys, hvals, partition, msg_id = rows[i]
                            if holding and topic in holding:
                                if topic in missing.reserved:
                                    failed = KafkaException(missing.reserved[topic])  # quarantined below
                                    break
                                i += 1  # held back behind its topic's first row, still marked
                                held += 1
                                continue
                            if by_runs:
                                run, partition = runs[i], parts[i]
                                if run < 0:
                                    callback = partial(report, row_id, leader_id)
                                elif last[i]:
                                    callback = partial(run_report, [*pending.get(run, ()), row_id], leader_id)
                                else:
                                    callback = None  # covered by its run's last record
                            else:
                                run, callback = -1, partial(report, row_id, leader_id)
                            # Positional, in the order of confluent-kafka's produce(topic, value, key,
                            # partition, callback, on_delivery, timestamp, headers): keywords cost
                            # ~1 µs a record here.
                            try:
                                produce(
                                    topic,
                                    value,
                                    key,
                                    -1 if partition is None else partition,
                                    callback,
                                    None,
                                    0,
                                    [*zip(hkeys, hvals), (mid, msg_id)] if hkeys else [(mid, msg_id)],
                                )
                            except (TypeError, ValueError, OverflowError) as exc:
                                # About this row's values alone (a 2-D header_values, a partition
                                # past int32): it can never be produced. Moved aside below.
                                refused = exc
                                break
                            i += 1
                            if run >= 0:
                                if callback is None:
                                    pending.setdefault(run, []).append(row_id)
                                else:
                                    pending.pop(run, None)
                            if trace is not None:
                                trace(topic, hkeys, hvals)
                    except (BufferError, KafkaException) as exc:
                        failed = exc  # rows[i] was not handed over
                if expired:
                    break
                if refused is not None:
                    row = rows[i]
                    reason = unfit_reason(row[4], row[5], row[6]) or (
                        f"produce() refused the record: {type(refused).__name__}: {str(refused)[:300]}"
                    )
                    self._quarantine_now(leader_id, row[0], reason)
                    quarantined += 1
                    i += 1
                    continue
                if failed is None:
                    continue
                row_id, topic, key, value, hkeys, hvals, own_partition, msg_id = rows[i]
                if isinstance(failed, KafkaException) and failed.args and isinstance(failed.args[0], KafkaError):
                    failed = KafkaException(invalid_topic(failed.args[0], topic) or failed.args[0])
                    if failed.args[0].code() == KafkaError._UNKNOWN_TOPIC:
                        # librdkafka knows the topic does not exist: hold its rows (see above)
                        missing.hold(topic, row_id)
                        i += 1
                        held += 1
                        continue
                if isinstance(failed, BufferError) or transient(failed):
                    # `run`, `partition` and `callback` are still the refused record's (`partition`
                    # the one computed for it: the row's own would let librdkafka's partitioner
                    # choose, maybe another partition than its run's)
                    args = (
                        topic,
                        value,
                        key,
                        -1 if partition is None else partition,
                        callback,
                        None,
                        0,
                        [*zip(hkeys, hvals), (mid, msg_id)] if hkeys else [(mid, msg_id)],  # as the first try
                    )
                    if not self._produce_again(producer, args, deadline, still_valid, failed):
                        break
                    i += 1
                    if run >= 0:
                        if callback is None:
                            pending.setdefault(run, []).append(row_id)
                        else:
                            pending.pop(run, None)
                    if trace is not None:
                        trace(topic, hkeys, hvals)
                    continue
                err = failed.args[0] if failed.args and isinstance(failed.args[0], KafkaError) else None
                if err is None or err.code() not in PERMANENT_PRODUCE:
                    raise failed
                if own_partition is None and err.code() == KafkaError._UNKNOWN_PARTITION:
                    # A partition computed from a count the producer no longer agrees with (the
                    # topic deleted and created again smaller): the count is stale, not the row.
                    self._counts.forget(topic)
                    raise failed
                # Never acceptable: move it aside (or stop here if that fails, so nothing of its
                # key overtakes it) and carry on with the next record.
                self._quarantine_now(leader_id, row_id, error_reason(err))
                quarantined += 1
                i += 1
        finally:
            sent = i - quarantined - held
            self.produced += sent
            # Handed over, but their run's last record was not (stopped early, or it was refused and
            # quarantined): no report will settle them. They stay marked by this leader id, and
            # the remark publishes them again (duplicates, never loss).
            uncovered = sum(map(len, pending.values()))
            if sent - uncovered < n:
                self.settler.release(n - sent + uncovered)  # includes the quarantined rows: settled here
            if uncovered:
                self.settler.uncovered(uncovered)
        return i

    def _produce_again(
        self, producer: ProducerLike, args: tuple, deadline: float, still_valid: Valid, failed: Exception
    ) -> bool:
        """produce() refused this record, and nothing after it was enqueued either, so producing
        the same record again keeps the order. A full local queue is waited out (up to
        queue_full_patience); a refusal that is neither about the record nor fatal (`transient`) is
        tried again up to PRODUCE_RETRIES times: giving up would leave the records of its
        partition run that were already handed over without a report, to be published again.
        False if the producer was retired meanwhile; raises the last refusal otherwise."""
        if isinstance(failed, BufferError):
            self.queue_full_waits += 1
        clock = time.monotonic
        give_up = min(deadline, clock() + self.queue_full_patience)
        tries = 0
        while True:
            if isinstance(failed, KafkaException):
                if not transient(failed) or tries >= PRODUCE_RETRIES or clock() >= deadline:
                    raise failed
                tries += 1
                self.settler.produce_refused()
            time.sleep(0.001)
            try:
                return self.slot.send(producer, args)
            except BufferError as exc:
                if clock() >= give_up or not still_valid():
                    raise
                failed = exc
            except KafkaException as exc:
                failed = exc

    def _quarantine_now(self, leader_id: uuid.UUID, row_id: int, reason: str) -> None:
        try:
            n = self._store.quarantine(leader_id, [row_id], reason)
        except Exception as exc:
            raise QuarantineError(row_id, reason, logs_safe(exc)) from exc
        if n != 1:
            raise QuarantineError(row_id, reason, "no longer marked by this leader id")
        self.settler.dead(n, [row_id], reason)
