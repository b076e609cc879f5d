"""The acker's offsets (step 5 of its loop, harvester.services.acker): which offsets of the ack topic
it may commit, committing them, rewinding a poll to retry it, and what a rebalance does to them.

An offset is committed only once its poll is applied in the database and its dead letters are in
Kafka. While masks are deferred (their batch was held by another transaction), the offsets of the
polls they came from are held back from their first offset, so a crash replays them (acks are
idempotent) and nothing is lost.
"""

from __future__ import annotations

import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from structlog.typing import FilteringBoundLogger


class AckOffsets:
    """One acker's offsets of its ack topic, per partition."""

    def __init__(self, topic: str, log: FilteringBoundLogger) -> None:
        self.topic = topic
        self.log = log
        # offsets applied in the database whose Kafka commit has not succeeded yet
        self.uncommitted: dict[int, int] = {}
        # partition -> first offset not safe to commit while something is deferred
        self.blocked: dict[int, int] = {}

    def applied(self, last: dict[int, int]) -> None:
        """A poll that got as far as `last` (partition -> last offset) is in the database."""
        for partition, offset in last.items():
            self.uncommitted[partition] = offset + 1

    def hold_back(self, first: dict[int, int]) -> None:
        """Masks of the poll that starts at `first` were deferred: commit nothing from there on."""
        for partition, offset in first.items():
            self.blocked[partition] = min(offset, self.blocked.get(partition, offset))

    def release(self) -> None:
        """Nothing is deferred any more: every applied offset may be committed."""
        self.blocked.clear()

    def commit(self, consumer: Consumer) -> None:
        if not self.uncommitted:
            return
        safe = {p: min(o, self.blocked.get(p, o)) for p, o in self.uncommitted.items()}
        offsets = [TopicPartition(self.topic, p, o) for p, o in safe.items()]
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
            for p, o in safe.items():
                if self.uncommitted.get(p) == o:
                    del self.uncommitted[p]
        except KafkaException as exc:
            # e.g. a rebalance in progress: the acks are in the database, so a replay is harmless
            code = exc.args[0].code() if exc.args and isinstance(exc.args[0], KafkaError) else None
            if code == KafkaError._NO_OFFSET:
                self.uncommitted.clear()
            else:
                self.log.info("offset commit failed; will retry", error=str(exc))

    def rewind(self, consumer: Consumer, first: dict[int, int]) -> None:
        """Seek each assigned partition of `first` back to its offset there: the poll comes again."""
        assigned = {tp.partition for tp in consumer.assignment()}
        for partition, offset in first.items():
            if partition in assigned:
                try:
                    consumer.seek(TopicPartition(self.topic, partition, offset))
                except KafkaException as exc:
                    self.log.warning("rewind failed", partition=partition, error=str(exc))

    def replay_held(self, consumer: Consumer) -> None:
        """Read again from the held-back offsets (what was deferred since must be applied again):
        nothing from there on is committed until the replay applies it."""
        for partition, offset in self.blocked.items():
            if partition in self.uncommitted:
                self.uncommitted[partition] = min(self.uncommitted[partition], offset)
        self.rewind(consumer, dict(self.blocked))

    # ---------------------------------------------------------------- rebalances

    def revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Everything applied so far is committed in the database: commit its offsets while we
        # still own the partitions, then forget them.
        revoked = {p.partition for p in partitions}
        mine = {p: min(o, self.blocked.get(p, o)) for p, o in self.uncommitted.items() if p in revoked}
        if mine:
            try:
                consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in mine.items()], asynchronous=False)
            except KafkaException as exc:
                self.log.info("offset commit on revoke failed; the new owner replays harmlessly", error=str(exc))
        for p in revoked:
            self.uncommitted.pop(p, None)
            self.blocked.pop(p, None)  # deferred masks are still applied: harmless if the new owner replays
        self.log.info("ack partitions revoked", partitions=sorted(revoked))

    def lose(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so commit nothing.
        for p in partitions:
            self.uncommitted.pop(p.partition, None)
            self.blocked.pop(p.partition, None)
        self.log.warning("ack partitions lost", partitions=[p.partition for p in partitions])


def first_offsets(messages: list[Any]) -> dict[int, int]:
    """partition -> the offset of its first message in `messages` (where a retry starts again)."""
    first: dict[int, int] = {}
    for msg in messages:
        if msg.error() is None:
            first.setdefault(msg.partition(), msg.offset())
    return first


def lag(consumer: Consumer, *, ask_broker: bool) -> int:
    """Messages in the consumer's assigned partitions beyond its position. The high watermark is
    the last fetch's (no round trip); ask_broker=True (paused partitions, never fetched, whose
    watermark stays where it was) asks the broker, for about a second at most, the rest cached.
    A partition paused before its first fetch has no position yet: its lag counts from the
    group's committed offset, or from the start of the partition where the group committed none
    or retention deleted what it committed (auto.offset.reset=earliest), not as nothing."""
    total = 0
    ask_until = time.monotonic() + 1.0 if ask_broker else 0.0
    try:
        assigned = consumer.assignment()
        for tp in consumer.position(assigned) if assigned else []:
            low, high = _watermarks(consumer, tp, ask_until)
            start = tp.offset if tp.offset >= 0 else _unfetched_start(consumer, tp, low, high, ask_until)
            # before the first fetch (and with no broker to ask) neither is known
            if high >= 0 and start >= 0:
                total += max(0, high - start)
    except KafkaException:
        return 0
    return total


def _watermarks(consumer: Consumer, tp: TopicPartition, ask_until: float) -> tuple[int, int]:
    left = ask_until - time.monotonic()
    if left > 0:
        try:
            got = consumer.get_watermark_offsets(tp, timeout=left, cached=False)
            if got is not None:
                return int(got[0]), int(got[1])
        except KafkaException:
            pass  # the broker did not answer in time: the last fetch's
    low, high = consumer.get_watermark_offsets(tp, cached=True)
    return int(low), int(high)


def _unfetched_start(consumer: Consumer, tp: TopicPartition, low: int, high: int, ask_until: float) -> int:
    """Where consumption of a partition with no position yet will start: the committed offset,
    else the partition's first; the first too when the committed offset is out of range (retention
    deleted its records, or the topic was made anew past it): the group then starts from the
    earliest. -1 when the broker is not asked or does not answer in time."""
    left = ask_until - time.monotonic()
    if left <= 0:
        return -1
    try:
        (committed,) = consumer.committed([TopicPartition(tp.topic, tp.partition)], timeout=left)
    except KafkaException:
        return -1
    return resume_offset(int(committed.offset), low, high)


def resume_offset(committed: int, earliest: int, end: int) -> int:
    """Where the acker's group (auto.offset.reset=earliest) starts reading a partition: its
    committed offset, or the earliest when none is committed (negative) or it is out of range."""
    return earliest if committed < earliest or committed > end >= 0 else committed
