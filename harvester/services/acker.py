"""The acker: consumes the ack topic in bulk and clears bits, one transaction per poll.

Runs in every reaper (a normal consumer group, not leader-only). Each loop:

1. `consume(num_messages=max_poll_records)`: a poll's worth of ack messages (each value is one or
   more ',' separated item ids or runs `<batch>:<group>:<start>-<end>`, an entry written after a
   '!' being a failure under its message's `failure-reason` header, see tracker.consumer);
2. fold them into one mask per (batch, group) and outcome (tracker.folding); malformed entries are
   set aside. Each batch's outcomes keep the order they were read in: the fold's steps (acks, or
   failures of one reason) are applied in order, a batch moving to its next step only when its
   outcome changes, so the first outcome of an item wins as if each message had been applied on
   its own. Acks of batches that never fail share one step (one statement), as before.
   A fold holds at most `max_groups` groups (1 KiB each; 4,096 by default, 4 MiB): a poll naming
   more is applied in several folds, each through steps 3-5, and a message that alone names more is
   dead-lettered as too large, so what anyone can write to the ack topic never costs more memory;
3. apply every step in one database transaction (`tracker.Tracker.apply_masks` for acks,
   `fail_masks` for each reason's failures, both with reject_invalid=True, skip_locked=True);
   unknown batches/groups, out-of-range indexes and expired batches come back as rejected. A batch
   whose row another transaction holds (a producer adding to it, a closer, a settle) is not waited
   for: its masks, in this step and every later one, are deferred (metric
   `reaper_acker_deferred_total`, a log line) and applied before the next poll's of that batch,
   and the offsets of every partition in the deferring poll
   stay uncommitted from that poll's first offset until nothing is deferred any more, so a crash
   replays them (harmlessly: acks are idempotent) and nothing is lost. The connection also has a
   `lock_timeout` (`lock_timeout` seconds): any other wait fails the poll, which is retried;
4. produce malformed and rejected entries to the dead-letter topic (reason in the `reason`
   header) and wait for Kafka to have them;
5. commit the consumed offsets, only now that the database commit and the dead letters are safe.

A crash anywhere before 5 replays the poll: the bits are already clear, so the replay changes
nothing (and completes nothing twice). A bad ack never blocks its partition: it is dead-lettered
and the offsets move past it. If the database or the dead-letter topic fails, the poll's
partitions are rewound to their first offset of the poll and retried after a back-off.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from harvester.db_liveness import with_liveness
from harvester.db_pool import needs_new_connection
from harvester.metrics import HarvesterMetrics
from harvester.metrics import get as get_metrics
from harvester.publishing.publisher import RECONNECT
from tracker.folding import FAIL_MARK, FAILURE_REASON_HEADER, GROUPS_PER_FOLD_MAX, Folded, fold_messages
from tracker.ids import GroupMask
from tracker.pooling import configure_for_pooler
from tracker.schema import check_identifier
from tracker.sync import Tracker

log = structlog.get_logger("reaper.acker")

REASON_HEADER = "reason"

# (reason or None for acks, masks): what one statement applies; a list of them is applied in order
Step = tuple[str | None, dict[tuple[int, int], GroupMask]]


@dataclass
class Applied:
    """What one apply of a list of steps did."""

    acked: int = 0
    failed: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str, str | None]] = field(default_factory=list)  # entry, why, failure reason
    skipped: list[Step] = field(default_factory=list)  # steps of batches held elsewhere, in order


class Acker:
    def __init__(
        self,
        *,
        dsn: str,
        schema: str,
        bootstrap_servers: str,
        kafka_client: dict | None = None,
        topic: str,
        group: str,
        dead_letter_topic: str,
        max_poll_records: int = 100_000,
        consumer_client: dict | None = None,
        producer_client: dict | None = None,
        poll_timeout: float = 0.2,
        lag_interval: float = 1.0,
        retry_backoff: float = 1.0,
        tracker: Tracker | None = None,
        lock_timeout: float = 2.0,
        deferred_retry: float = 0.05,
        max_groups: int = GROUPS_PER_FOLD_MAX,
        metrics: HarvesterMetrics | None = None,
    ) -> None:
        self.dsn = dsn
        self.schema = check_identifier(schema, "schema")
        # the sidecar's collectors (default: those of the default prefix)
        self.metrics = metrics if metrics is not None else get_metrics()
        # this acker's series of the acker collectors, and its log lines: both carry its schema
        m = self.metrics
        self._lag = m.acker_lag.labels(self.schema)
        self._deferred_masks = m.acker_deferred_masks.labels(self.schema)
        self._deferred_total = m.acker_deferred.labels(self.schema)
        self._failures_applied = m.acker_failures_applied.labels(self.schema)
        self._dead_lettered = m.acks_dead_lettered.labels(self.schema)
        self.log = log.bind(schema=self.schema)
        # where acks are applied and completion events written (its schema must be `schema`)
        self.tracker = (
            tracker if tracker is not None else Tracker(schema=self.schema, metrics_prefix=self.metrics.prefix)
        )
        if self.tracker.schema != self.schema:
            raise ValueError(f"the acker's tracker is for schema {self.tracker.schema!r}, not {self.schema!r}")
        self.topic = topic
        self.group = group
        self.dead_letter_topic = dead_letter_topic
        if int(max_poll_records) < 1:
            raise ValueError(f"max_poll_records must be >= 1, got {max_poll_records!r}")
        self.max_poll_records = min(int(max_poll_records), 1_000_000)  # confluent-kafka's consume() limit
        self.poll_timeout = float(poll_timeout)
        self.lag_interval = lag_interval
        self.retry_backoff = retry_backoff
        if not 0 < float(lock_timeout) <= 3600 or not 0 < float(deferred_retry) <= 60:
            raise ValueError(
                f"lock_timeout must be in (0, 3600] and deferred_retry in (0, 60] seconds, "
                f"got {lock_timeout!r}, {deferred_retry!r}"
            )
        self.lock_timeout = float(lock_timeout)
        self.deferred_retry = float(deferred_retry)
        if not isinstance(max_groups, int) or max_groups < 1:
            raise ValueError(f"max_groups must be a whole number >= 1, got {max_groups!r}")
        # groups one fold (one apply) holds at most: 1 KiB each, whatever the ack topic carries
        self.max_groups = max_groups
        # steps of batches that were locked elsewhere, applied before the next poll's (or on their own)
        self._deferred: list[Step] = []
        self._paused = False  # the assigned partitions, while the deferred masks fill a fold
        # partition -> first offset not safe to commit while something is deferred
        self._blocked: dict[int, int] = {}
        self._deferred_logged = 0.0
        client = dict(kafka_client or {})
        self._consumer_conf = {
            # Tuning the configuration may override. Ack messages are tiny: with the default 1 MiB
            # per partition per fetch, 1M single-id acks took 7.3 s to consume here; with 8 MiB, 0.9 s.
            # Prefetching several polls ahead (still capped by queued.max.messages.kbytes, 64 MiB
            # per partition) took the acker from 2.6 s to 1.9 s per 1M single-id acks.
            "max.partition.fetch.bytes": 8 << 20,
            "queued.min.messages": max(500_000, 5 * self.max_poll_records),
            "partition.assignment.strategy": "cooperative-sticky",
            "auto.offset.reset": "earliest",
            **RECONNECT,  # back within a second of a broker's return, not librdkafka's 10 s back-off
            **client,
            **(consumer_client or {}),
            # What the acker's correctness rests on: offsets are committed by hand after the database.
            "bootstrap.servers": bootstrap_servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            # librdkafka's lines through logging (the reaper bridges it to structlog), never raw to stderr
            "logger": logging.getLogger("reaper.kafka.acker-consumer"),
        }
        self._producer_conf = {
            "linger.ms": 5,
            **RECONNECT,
            **client,
            **(producer_client or {}),
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "logger": logging.getLogger("reaper.kafka.dead-letter-producer"),
        }
        # offsets applied in the database whose Kafka commit has not succeeded yet
        self._uncommitted: dict[int, int] = {}
        self._consumer: Consumer | None = None
        self._conn: psycopg.Connection | None = None
        self._lag_due = 0.0
        # what this acker did, per instance (the Prometheus metrics are process-wide)
        self.stats = {
            "polls": 0,
            "messages": 0,
            "acked": 0,
            "failed": 0,
            "duplicates": 0,
            "completed": 0,
            "dead_lettered": 0,
            "retries": 0,
            "deferred": 0,
        }

    # ---------------------------------------------------------------- loop

    def run(self, stop: threading.Event) -> None:
        """Consume and apply until `stop` is set; then commit what was applied and leave the group."""
        consumer = self._consumer = Consumer(self._consumer_conf)
        producer = Producer(self._producer_conf)
        try:
            consumer.subscribe(
                [self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
            )
            self.log.info("acker started", topic=self.topic, group=self.group, dead_letter_topic=self.dead_letter_topic)
            while not stop.is_set():
                self._pause_while_deferred_fill(consumer)
                messages = consumer.consume(num_messages=self.max_poll_records, timeout=self.poll_timeout)
                if messages:
                    if not self._handle(consumer, producer, messages):
                        stop.wait(self.retry_backoff)
                elif self._deferred:
                    self._retry_deferred(consumer)
                    if self._deferred:
                        stop.wait(self.deferred_retry)
                self._update_lag(consumer)
        finally:
            try:
                self._commit(consumer)
                consumer.close()  # runs on_revoke, then leaves the group
            finally:
                producer.flush(10)
                if self._conn is not None:
                    self._conn.close()
                self._lag.set(0)
                self.log.info("acker stopped", **self.stats)

    def _pause_while_deferred_fill(self, consumer: Consumer) -> None:
        """No new acks are fetched while the deferred masks fill a fold (a batch held locked for
        long); consume() still runs, so the acker stays in its group and retries the deferred."""
        full = _masks_in(self._deferred) >= self.max_groups
        if full != self._paused:
            partitions = consumer.assignment()
            (consumer.pause if full else consumer.resume)(partitions)
            self._paused = full
            self.log.info("ack partitions paused: deferred masks fill a fold" if full else "ack partitions resumed")

    def _handle(self, consumer: Consumer, producer: Producer, messages: list[Any]) -> bool:
        """One poll: fold, apply, dead-letter, commit, in as many folds as the poll's groups need
        (each fold holds a bounded number of groups). False if it must be retried."""
        while messages:
            # Deferred masks count against the bound: while they fill it, no more is folded and the
            # rest of the poll comes again later (the partitions are paused until there is room).
            room = self.max_groups - _masks_in(self._deferred)
            if room <= 0:
                self._rewind(consumer, _first_offsets(messages))
                return True
            folded = fold_messages(messages, max_groups=self.max_groups, room=room)
            if not self._handle_fold(consumer, producer, folded, _first_offsets(messages)):
                return False  # rewound to `messages`' first offsets: the rest of the poll comes again
            messages = folded.rest
        return True

    def _handle_fold(self, consumer: Consumer, producer: Producer, folded: Folded, rewind: dict[int, int]) -> bool:
        for err in folded.errors:
            if err.code() != KafkaError._PARTITION_EOF:
                self.log.warning("consumer error", error=str(err))
        if not folded.messages:
            return True
        held = self._deferred
        steps = _relevel(self._deferred + folded.steps) if self._deferred else folded.steps
        try:
            result = self._apply(steps)
            dead = self._dead_letter(producer, folded, result)
        except Exception as exc:
            self.stats["retries"] += 1
            self.log.warning("ack poll failed; rewinding to retry", error=str(exc), error_type=type(exc).__name__)
            self._deferred = held
            self._rewind(consumer, rewind)
            return False
        self.stats["polls"] += 1
        self.stats["messages"] += folded.messages
        self._count(result)
        self.stats["dead_lettered"] += dead
        for partition, offset in folded.last.items():
            self._uncommitted[partition] = offset + 1
        self._defer(result, folded.first)
        self._commit(consumer)
        return True

    def _count(self, result: Applied) -> None:
        self.stats["acked"] += result.acked
        self.stats["failed"] += result.failed
        self.stats["duplicates"] += result.duplicates
        self.stats["completed"] += len(result.completed)
        if result.failed:
            self._failures_applied.inc(result.failed)

    def _defer(self, result: Applied, first: dict[int, int]) -> None:
        """Keep what was skipped for the next apply; hold back the offsets it came from."""
        self._deferred = result.skipped
        if not result.skipped:
            self._blocked.clear()
            self._deferred_masks.set(0)
            return
        for partition, offset in first.items():
            self._blocked[partition] = min(offset, self._blocked.get(partition, offset))
        self.stats["deferred"] += 1
        self._deferred_total.inc()
        masks = _masks_in(result.skipped)
        self._deferred_masks.set(masks)
        now = time.monotonic()
        if now - self._deferred_logged >= 1.0:  # at most one line a second while a batch stays locked
            self._deferred_logged = now
            batches = sorted({b for _r, step in result.skipped for b, _g in step})
            self.log.info(
                "acks deferred: batch rows locked by another transaction; retrying",
                batches=batches[:10],
                batch_count=len(batches),
                masks=masks,
            )

    def _retry_deferred(self, consumer: Consumer) -> None:
        """No new messages: apply the deferred masks on their own."""
        try:
            result = self._apply(self._deferred)
        except Exception as exc:
            self.stats["retries"] += 1
            self.log.warning("deferred acks failed; will retry", error=str(exc), error_type=type(exc).__name__)
            return
        self._count(result)
        # (nothing is rejected here: these masks were valid when they were deferred, and a batch
        # that has since expired or gone simply has nothing left to clear)
        self._defer(result, {})
        self._commit(consumer)

    def _apply(self, steps: list[Step]) -> Applied:
        """Apply the steps in order, in one transaction. A batch another transaction holds is not
        waited for: its masks in that step and every later one come back in `skipped`, in order."""
        if not any(masks for _r, masks in steps):
            return Applied()
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            conn = self._conn = psycopg.connect(with_liveness(self.dsn), autocommit=True)
            configure_for_pooler(conn)  # PgBouncer in transaction mode: no prepared statements
        out = Applied()
        try:
            with conn.transaction():  # every step in one transaction: all of the poll or none
                # Set for this transaction only (a transaction pooler hands the session to others):
                # a bound on any wait SKIP LOCKED does not cover (the poll is then retried), and a
                # commit that waits for the WAL flush whatever the role says, since the offsets are
                # committed to Kafka after it and acks lost in a crash would never come again.
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true), set_config('synchronous_commit', 'on', true)",
                    [f"{int(self.lock_timeout * 1000)}ms"],
                )
                # every batch locked at once, one statement a step, sent together: a batch held
                # elsewhere is skipped in every step, its masks kept in their order
                results = self.tracker.apply_outcomes(conn, steps, reject_invalid=True, skip_locked=True)
        except psycopg.Error as exc:
            if needs_new_connection(exc):
                conn.close()  # a read-only or departing server: the DSN picks the primary anew
            if conn.broken or conn.closed:
                self._conn = None
            raise
        for (reason, _masks), result in zip(steps, results):
            if reason is None:
                out.acked += result.acked
            else:
                out.failed += result.acked
            out.duplicates += result.duplicates
            out.completed.extend(result.completed)
            out.rejected.extend((entry, why, reason) for entry, why in result.rejected)
            if result.skipped:
                out.skipped.append((reason, result.skipped))
        return out

    def _dead_letter(self, producer: Producer, folded: Folded, result: Applied) -> int:
        """Bad and rejected entries to the dead-letter topic, each as a message that could be sent
        to the ack topic again (a failure keeps its '!' and its failure-reason header), with the
        reason it was set aside in the `reason` header."""
        letters: list[tuple[bytes | None, bytes | None, list[tuple[str, str | bytes | None]]]] = []
        source = self.topic.encode()
        for n, (key, entry, reason, partition, offset) in enumerate(folded.bad):
            headers: list[tuple[str, str | bytes | None]] = [
                (REASON_HEADER, reason.encode()),
                ("source-topic", source),
                ("source-partition", str(partition).encode()),
                ("source-offset", str(offset).encode()),
            ]
            failure = folded.bad_failure.get(n)
            if failure is not None:
                headers.append((FAILURE_REASON_HEADER, failure))
            letters.append((key, entry, headers))
        for rejected, reason, failure_reason in result.rejected:
            batch_id = rejected.split(":", 1)[0].encode()
            headers = [(REASON_HEADER, reason.encode()), ("source-topic", source)]
            if failure_reason is not None:
                headers.append((FAILURE_REASON_HEADER, failure_reason.encode()))
                rejected = FAIL_MARK + rejected
            letters.append((batch_id, rejected.encode(), headers))
        if not letters:
            return 0
        failures: list[str] = []

        def delivered(err: KafkaError | None, _msg: Any) -> None:
            if err is not None:
                failures.append(str(err))

        for key, value, headers in letters:
            while True:
                try:
                    producer.produce(
                        self.dead_letter_topic, key=key, value=value, headers=headers, on_delivery=delivered
                    )
                    break
                except BufferError:
                    producer.poll(0.1)
        left = producer.flush(30)
        if left or failures:
            raise KafkaException(
                KafkaError(
                    KafkaError._MSG_TIMED_OUT if left else KafkaError._FAIL,
                    f"dead letters not delivered: {left} queued, failures {failures[:3]}",
                )
            )
        self._dead_lettered.inc(len(letters))
        self.log.warning(
            "acks dead-lettered",
            count=len(letters),
            first=(letters[0][1] or b"")[:200].decode("ascii", "replace"),
            reason=str(letters[0][2][0][1], "utf-8") if isinstance(letters[0][2][0][1], bytes) else letters[0][2][0][1],
        )
        return len(letters)

    def _commit(self, consumer: Consumer) -> None:
        if not self._uncommitted:
            return
        safe = {p: min(o, self._blocked.get(p, o)) for p, o in self._uncommitted.items()}
        offsets = [TopicPartition(self.topic, p, o) for p, o in safe.items()]
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
            for p, o in safe.items():
                if self._uncommitted.get(p) == o:
                    del self._uncommitted[p]
        except KafkaException as exc:
            # e.g. a rebalance in progress: the acks are in the database, so a replay is harmless
            code = exc.args[0].code() if exc.args and isinstance(exc.args[0], KafkaError) else None
            if code == KafkaError._NO_OFFSET:
                self._uncommitted.clear()
            else:
                self.log.info("offset commit failed; will retry", error=str(exc))

    def _rewind(self, consumer: Consumer, first: dict[int, int]) -> None:
        assigned = {tp.partition for tp in consumer.assignment()}
        for partition, offset in first.items():
            if partition in assigned:
                try:
                    consumer.seek(TopicPartition(self.topic, partition, offset))
                except KafkaException as exc:
                    self.log.warning("rewind failed", partition=partition, error=str(exc))

    # ---------------------------------------------------------------- rebalances

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.log.info("ack partitions assigned", partitions=[p.partition for p in partitions])
        self._paused = False  # an assignment starts unpaused: the loop pauses it again if need be

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Everything applied so far is committed in the database: commit its offsets while we
        # still own the partitions, then forget them.
        revoked = {p.partition for p in partitions}
        mine = {p: min(o, self._blocked.get(p, o)) for p, o in self._uncommitted.items() if p in revoked}
        if mine:
            try:
                consumer.commit(offsets=[TopicPartition(self.topic, p, o) for p, o in mine.items()], asynchronous=False)
            except KafkaException as exc:
                self.log.info("offset commit on revoke failed; the new owner replays harmlessly", error=str(exc))
        for p in revoked:
            self._uncommitted.pop(p, None)
            self._blocked.pop(p, None)  # deferred masks are still applied: harmless if the new owner replays
        self.log.info("ack partitions revoked", partitions=sorted(revoked))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so commit nothing.
        for p in partitions:
            self._uncommitted.pop(p.partition, None)
            self._blocked.pop(p.partition, None)
        self.log.warning("ack partitions lost", partitions=[p.partition for p in partitions])

    # ---------------------------------------------------------------- lag

    def _update_lag(self, consumer: Consumer) -> None:
        now = time.monotonic()
        if now < self._lag_due:
            return
        self._lag_due = now + self.lag_interval
        self._lag.set(self.lag(consumer))

    def lag(self, consumer: Consumer | None = None) -> int:
        """Messages in the assigned partitions beyond this acker's position (high watermark from
        the last fetch, no broker round trip)."""
        consumer = consumer or self._consumer
        if consumer is None:
            return 0
        total = 0
        try:
            assigned = consumer.assignment()
            for tp in consumer.position(assigned) if assigned else []:
                _low, high = consumer.get_watermark_offsets(tp, cached=True)
                # before the first fetch neither the position nor the high watermark is known
                if high >= 0 and tp.offset >= 0:
                    total += max(0, high - tp.offset)
        except KafkaException:
            return 0
        return total


def _first_offsets(messages: list[Any]) -> dict[int, int]:
    """partition -> the offset of its first message in `messages` (where a retry starts again)."""
    first: dict[int, int] = {}
    for msg in messages:
        if msg.error() is None:
            first.setdefault(msg.partition(), msg.offset())
    return first


def _masks_in(steps: list[Step]) -> int:
    return sum(len(masks) for _r, masks in steps)


def _relevel(steps: list[Step]) -> list[Step]:
    """The same steps in few statements, each batch's order kept. A batch's outcomes are runs of
    acks and of failures (a run of failures under one or more reasons, kept disjoint: the earlier
    reason keeps an item); the runs of each batch in turn (in order of first appearance) are placed
    in order into the levels built so far, each run into an existing level or a new one inserted
    between them, choosing the placement that adds the fewest statements (a statement per (level,
    reason)). Masks are merged into copies: the given ones are left as they were."""
    # batch -> its runs in order: (failed, reason -> (batch, group) -> mask)
    runs: dict[int, list[tuple[bool, dict[str | None, dict[tuple[int, int], GroupMask]]]]] = {}
    for reason, masks in steps:
        failed = reason is not None
        for key, mask in masks.items():
            mine = runs.setdefault(key[0], [])
            if not mine or mine[-1][0] != failed:
                mine.append((failed, {}))
            by_reason = mine[-1][1]
            if failed:
                taken = 0
                for other, held in by_reason.items():
                    if other != reason and key in held:
                        taken |= int.from_bytes(held[key].bits.ljust(len(mask.bits), b"\0")[: len(mask.bits)], "big")
                if taken:
                    bits = int.from_bytes(mask.bits, "big") & ~taken
                    mask = GroupMask(
                        mask.batch_id,
                        mask.group_id,
                        bytearray(bits.to_bytes(len(mask.bits), "big")),
                        mask.max_index,
                        mask.count,
                    )
            into = by_reason.setdefault(reason, {})
            before = into.get(key)
            if before is None:
                into[key] = mask
            else:
                copy = GroupMask(
                    before.batch_id, before.group_id, bytearray(before.bits), before.max_index, before.count
                )
                copy.merge(mask)
                into[key] = copy
    levels: list[dict[str | None, dict[tuple[int, int], GroupMask]]] = []
    for mine in runs.values():
        levels = _place(levels, [by_reason for _failed, by_reason in mine])
    return [(reason, masks) for level in levels for reason, masks in level.items()]


def _place(
    levels: list[dict[str | None, dict[tuple[int, int], GroupMask]]],
    runs: list[dict[str | None, dict[tuple[int, int], GroupMask]]],
) -> list[dict[str | None, dict[tuple[int, int], GroupMask]]]:
    """The levels with one batch's runs placed in order, fewest statements added: an alignment of
    the runs with the levels, each run joining a level (a statement for each of its reasons the
    level lacks) or a new level inserted (a statement for each of its reasons)."""
    n, k = len(levels), len(runs)
    join = [[sum(r not in level for r in run) for level in levels] for run in runs]
    cost = [[0] * (n + 1) for _ in range(k + 1)]
    for i in range(1, k + 1):
        cost[i][0] = cost[i - 1][0] + len(runs[i - 1])
        for j in range(1, n + 1):
            cost[i][j] = min(
                cost[i][j - 1],  # level j-1 holds none of these runs
                cost[i - 1][j - 1] + join[i - 1][j - 1],  # run i-1 joins level j-1
                cost[i - 1][j] + len(runs[i - 1]),  # run i-1 in a new level after level j-1
            )
    joins: dict[int, int] = {}  # run -> the level it joins
    new: dict[int, list[int]] = {}  # j -> runs in new levels inserted before level j, in order
    i, j = k, n
    while i > 0:
        if j > 0 and cost[i][j] == cost[i - 1][j - 1] + join[i - 1][j - 1]:
            joins[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif j > 0 and cost[i][j] == cost[i][j - 1]:
            j -= 1
        else:
            new.setdefault(j, []).insert(0, i - 1)
            i -= 1
    out: list[dict[str | None, dict[tuple[int, int], GroupMask]]] = []
    for j in range(n + 1):
        out.extend({reason: dict(masks) for reason, masks in runs[r].items()} for r in new.get(j, ()))
        if j < n:
            out.append(levels[j])
    for r, j in joins.items():
        for reason, masks in runs[r].items():
            levels[j].setdefault(reason, {}).update(masks)
    return out
