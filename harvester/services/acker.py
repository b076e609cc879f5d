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
3. apply every step in one database transaction (harvester.services.ack_apply:
   `tracker.Tracker.apply_masks` for acks, `fail_masks` for each reason's failures, both with
   reject_invalid=True, skip_locked=True); unknown batches/groups, out-of-range indexes and expired
   batches come back as rejected. A batch whose row another transaction holds (a producer adding
   to it, a closer, a settle) is not waited for: its masks, in this step and every later one, are
   deferred (metric `reaper_acker_deferred_total`, a log line) and applied before the next poll's
   of that batch (merged with them by harvester.services.ack_steps), and the offsets of every
   partition in the deferring poll stay uncommitted from that poll's first offset until nothing is
   deferred any more, so a crash replays them (harmlessly: acks are idempotent) and nothing is
   lost. The transaction also has a `lock_timeout` (`lock_timeout` seconds): any other wait fails
   the poll, which is retried;
4. produce malformed and rejected entries to the dead-letter topic (reason in the `reason`
   header; harvester.services.ack_dead_letters) and wait for Kafka to have them;
5. commit the consumed offsets, only now that the database commit and the dead letters are safe.

A crash anywhere before 5 replays the poll: the bits are already clear, so the replay changes
nothing (and completes nothing twice). A bad ack never blocks its partition: it is dead-lettered
and the offsets move past it. If the database or the dead-letter topic fails, the poll's
partitions are rewound to their first offset of the poll and retried after a back-off.

This module is the loop: consuming, folding, deferring, pausing, lag. Its parts live beside it:
the steps merged with the deferred (ack_steps), the database transaction (ack_apply), the dead
letters (ack_dead_letters), and the offsets, their commits and rebalances (ack_offsets).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import structlog
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition

from harvester.election.timeouts import silent_broker_defaults
from harvester.metrics import HarvesterMetrics
from harvester.metrics import get as get_metrics
from harvester.publishing.publisher import RECONNECT
from harvester.services import ack_dead_letters as dead_letters
from harvester.services.ack_apply import Applied, StepApplier
from harvester.services.ack_offsets import AckOffsets, first_offsets, lag
from harvester.services.ack_steps import Step, masks_in, relevel
from tracker.folding import GROUPS_PER_FOLD_MAX, Folded, fold_messages
from tracker.schema import check_identifier
from tracker.sync import Tracker

log = structlog.get_logger("reaper.acker")


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
        silent_wait_ms: int | None = None,
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
        # where the folded steps are applied, on the acker's own database connection
        self.applier = StepApplier(dsn=dsn, tracker=self.tracker, lock_timeout=self.lock_timeout)
        if not isinstance(max_groups, int) or max_groups < 1:
            raise ValueError(f"max_groups must be a whole number >= 1, got {max_groups!r}")
        # groups one fold (one apply) holds at most: 1 KiB each, whatever the ack topic carries
        self.max_groups = max_groups
        # steps of batches that were locked elsewhere, applied before the next poll's (or on their own)
        self._deferred: list[Step] = []
        # the assigned partitions are paused, while the deferred masks fill a fold; None after an
        # assignment change (librdkafka keeps kept partitions paused, starts new ones fetching):
        # the next loop pauses or resumes the whole assignment
        self._paused: bool | None = False
        self._deferred_logged = 0.0
        client = dict(kafka_client or {})
        # How long a fetch, an offset commit or a dead letter waits on a broker that does not answer
        # (harvester.election.timeouts): with librdkafka's 60 s, a silent broker's partitions, or the
        # whole acker when it coordinates the group, applied no acks for a minute after Kafka had moved
        # them. None: librdkafka's defaults (`reaper run` derives it from the election's settings).
        silent = {} if silent_wait_ms is None else silent_broker_defaults(silent_wait_ms)
        silent_producer = {} if silent_wait_ms is None else silent_broker_defaults(silent_wait_ms, producer=True)
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
            **silent,
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
            **silent_producer,
            **client,
            **(producer_client or {}),
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "logger": logging.getLogger("reaper.kafka.dead-letter-producer"),
            # A fatal error leaves an idempotent producer refusing every record for good: it is
            # replaced before the next poll (the failed letters' poll is rewound and comes again).
            "error_cb": self._on_producer_error,
        }
        self._producer_broken = False
        # what of the ack topic is applied, and what of that may be committed
        self.offsets = AckOffsets(topic, self.log)
        self._consumer: Consumer | None = None
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
            "dead_letters_truncated": 0,
            "dead_letters_dropped": 0,
        }

    # ---------------------------------------------------------------- loop

    def run(self, stop: threading.Event) -> None:
        """Consume and apply until `stop` is set; then commit what was applied and leave the group."""
        consumer = self._consumer = Consumer(self._consumer_conf)
        producer = Producer(self._producer_conf)
        try:
            consumer.subscribe(
                [self.topic], on_assign=self._on_assign, on_revoke=self.offsets.revoke, on_lost=self.offsets.lose
            )
            self.log.info("acker started", topic=self.topic, group=self.group, dead_letter_topic=self.dead_letter_topic)
            while not stop.is_set():
                if self._producer_broken:
                    producer = self._replace_producer(producer)
                self._pause_while_deferred_fill(consumer)
                messages = consumer.consume(num_messages=self.max_poll_records, timeout=self.poll_timeout)
                if messages:
                    if not self._handle(consumer, producer, messages):
                        stop.wait(self.retry_backoff)
                elif self._deferred:
                    self._retry_deferred(consumer, producer)
                    if self._deferred:
                        stop.wait(self.deferred_retry)
                self._update_lag(consumer)
                # The dead-letter producer's log lines (its connection trouble, say) are served
                # only by its poll: without one they would wait for the next dead letter, or the
                # stop, to be logged at all.
                producer.poll(0)
        finally:
            try:
                self._commit(consumer)
                consumer.close()  # runs on_revoke, then leaves the group
            finally:
                producer.flush(10)
                self.applier.close()
                self._lag.set(0)
                self.log.info("acker stopped", **self.stats)

    def _on_producer_error(self, err: KafkaError) -> None:
        if err.fatal():  # (other client errors are librdkafka's own log lines already)
            self._producer_broken = True
            self.log.error("fatal dead-letter producer error; replacing the producer", error=str(err))

    def _replace_producer(self, broken: Producer) -> Producer:
        try:
            broken.purge(in_queue=True, in_flight=True)  # nothing it holds can be delivered any more
            broken.flush(0)
        except Exception as exc:  # a broken producer may refuse; it gets nothing more either way
            self.log.warning("purging the broken dead-letter producer failed", error=str(exc))
        self._producer_broken = False
        producer = Producer(self._producer_conf)
        self.log.warning("dead-letter producer replaced")
        return producer

    def _pause_while_deferred_fill(self, consumer: Consumer) -> None:
        """No new acks are fetched while the deferred masks fill a fold (a batch held locked for
        long); consume() still runs, so the acker stays in its group and retries the deferred."""
        full = masks_in(self._deferred) >= self.max_groups
        if full != self._paused:
            partitions = consumer.assignment()
            (consumer.pause if full else consumer.resume)(partitions)
            if self._paused is not None or full:
                self.log.info("ack partitions paused: deferred masks fill a fold" if full else "ack partitions resumed")
            self._paused = full

    def _handle(self, consumer: Consumer, producer: Producer, messages: list[Any]) -> bool:
        """One poll: fold, apply, dead-letter, commit, in as many folds as the poll's groups need
        (each fold holds a bounded number of groups). False if it must be retried."""
        while messages:
            # Deferred masks count against the bound: while they fill it, no more is folded and the
            # rest of the poll comes again later (the partitions are paused until there is room).
            room = self.max_groups - masks_in(self._deferred)
            if room <= 0:
                self.offsets.rewind(consumer, first_offsets(messages))
                return True
            folded = fold_messages(messages, max_groups=self.max_groups, room=room)
            if not self._handle_fold(consumer, producer, folded, first_offsets(messages)):
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
        steps = relevel(self._deferred + folded.steps) if self._deferred else folded.steps
        try:
            result = self._apply(steps)
            self._count(result)  # committed: counted now, though its dead letters may fail and the poll come again
            dead = self._dead_letter(producer, folded, result)
        except Exception as exc:
            self.stats["retries"] += 1
            self.log.warning("ack poll failed; rewinding to retry", error=str(exc), error_type=type(exc).__name__)
            self._deferred = held
            self.offsets.rewind(consumer, rewind)
            return False
        self.stats["polls"] += 1
        self.stats["messages"] += folded.messages
        self.stats["dead_lettered"] += dead
        self.offsets.applied(folded.last)
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
            self.offsets.release()
            self._deferred_masks.set(0)
            return
        self.offsets.hold_back(first)
        self.stats["deferred"] += 1
        self._deferred_total.inc()
        masks = masks_in(result.skipped)
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

    def _retry_deferred(self, consumer: Consumer, producer: Producer) -> None:
        """No new messages: apply the deferred masks on their own, and dead-letter what the database
        rejects of them (they were deferred unchecked: their batch row was held)."""
        try:
            result = self._apply(self._deferred)
        except Exception as exc:
            self.stats["retries"] += 1
            self.log.warning("deferred acks failed; will retry", error=str(exc), error_type=type(exc).__name__)
            return
        self._count(result)
        try:
            self.stats["dead_lettered"] += self._dead_letter(producer, Folded(), result)
        except Exception as exc:
            # Applied, but the rejected entries are only in memory: read the deferring polls again
            # from their held-back offsets (never committed past), which rejects them again.
            self.stats["retries"] += 1
            self.log.warning(
                "dead letters of deferred acks failed; rewinding to retry",
                error=str(exc),
                error_type=type(exc).__name__,
            )
            self._deferred = []
            self._deferred_masks.set(0)
            self.offsets.replay_held(consumer)
            return
        self._defer(result, {})
        self._commit(consumer)

    def _apply(self, steps: list[Step]) -> Applied:
        """Apply the steps in order, in one transaction (harvester.services.ack_apply). A batch
        another transaction holds is not waited for: its masks come back in `skipped`, in order."""
        return self.applier.apply(steps)

    def _dead_letter(self, producer: Producer, folded: Folded, result: Applied) -> int:
        """Bad and rejected entries to the dead-letter topic (harvester.services.ack_dead_letters),
        once Kafka has them all; how many."""
        letters = dead_letters.letters_of(self.topic, folded, result.rejected)
        if not letters:
            return 0
        done = dead_letters.deliver(producer, self.dead_letter_topic, letters)
        self._dead_lettered.inc(done.sent)
        self.stats["dead_letters_truncated"] += done.truncated
        self.stats["dead_letters_dropped"] += len(done.dropped)
        self.log.warning(
            "acks dead-lettered",
            count=done.sent,
            truncated=done.truncated,
            first=(letters[0][1] or b"")[:200].decode("ascii", "replace"),
            reason=str(letters[0][2][0][1], "utf-8") if isinstance(letters[0][2][0][1], bytes) else letters[0][2][0][1],
        )
        if done.dropped:
            # Kafka refuses these for good: retrying would stall the partition forever
            self.log.error("dead letters refused by Kafka; dropped", count=len(done.dropped), errors=done.dropped[:3])
        return done.sent

    def _commit(self, consumer: Consumer) -> None:
        """Commit what is applied and not held back (harvester.services.ack_offsets)."""
        self.offsets.commit(consumer)

    # ---------------------------------------------------------------- rebalances

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.log.info("ack partitions assigned", partitions=[p.partition for p in partitions])
        self._paused = None  # new partitions fetch, kept ones stay as they were: the loop sets them all

    # ---------------------------------------------------------------- lag

    def _update_lag(self, consumer: Consumer) -> None:
        now = time.monotonic()
        if now < self._lag_due:
            return
        self._lag_due = now + self.lag_interval
        self._lag.set(self.lag(consumer))

    def lag(self, consumer: Consumer | None = None) -> int:
        """Messages in the assigned partitions beyond this acker's position (harvester.services.ack_offsets.lag:
        the high watermark of the last fetch; while paused nothing is fetched, so the broker's)."""
        consumer = consumer or self._consumer
        return 0 if consumer is None else lag(consumer, ask_broker=self._paused is not False)
