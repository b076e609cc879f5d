"""The delivery settler: delivery reports become batched purges, resets and quarantines; the throttle's count.

Contract:
- `report()` (librdkafka's delivery callback, from whichever thread serves the producer),
  `report_run()` (the same for a run of records, harvester.publishing.runs) and `file()` (a
  committed transaction's reports) queue reports, one per row; `workers` threads, each on its own
  pooled connection, settle them in batches of up to `batch` (queued reports wait up to
  SETTLE_EVERY, or until `batch` of them are queued; a committed transaction's at once):
  delivered rows are purged, failed rows reset, rows Kafka can never accept quarantined, each
  only while still marked by the leader id of the report (a newer leadership owns the row otherwise).
- Every row counted by `reserve()` is uncounted exactly once: by `release()` (never produced, or
  dropped) or by being settled. `wait_below()` and `drain()` wait on that count.
- A failed database statement leaves its rows marked and raises `on_failure` (a remark publishes
  them again: duplicates, never loss).
- The counters (`delivered`, `purged_rows`, `dead_rows`) only grow, under one lock: several workers
  and the producing thread add to them, and the remark back-off reads them.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable
from itertools import repeat
from operator import is_, itemgetter

from confluent_kafka import KafkaError

from harvester import logs
from harvester.config import redact_dsn
from harvester.metrics import MetricsLike
from harvester.publishing.ports import StoreLike
from harvester.publishing.runs import ALONE_FOR
from harvester.publishing.topic_limits import TopicLimits
from tracker import is_topic_name

_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
# Delivery-report errors that concern this record alone and can never succeed. Deliberately NOT here:
# - MSG_SIZE_TOO_LARGE, INVALID_RECORD, RECORD_LIST_TOO_LARGE from the broker: they fail a whole
#   request batch, and quarantining would bury the good records that shared it; nor can its size
#   alone tell which record the topic can never take (the broker judges the compressed batch).
#   A record above the producer's message.max.bytes is refused by produce() and quarantined at
#   once; a topic whose max.message.bytes is lower is an operator's fix away (the settler's error
#   line, _advise_size, says what to set);
# - TOPIC_AUTHORIZATION_FAILED, _UNKNOWN_TOPIC, UNKNOWN_TOPIC_OR_PART: an ACL or a topic not yet
#   created (brokers here do not auto-create) is an operator's fix away; quarantining would move
#   every row of that topic out of the outbox. They are retried, with the remark back-off.
PERMANENT_DELIVERY = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._INVALID_ARG, KafkaError.TOPIC_EXCEPTION})
_UNKNOWN_TOPIC = (KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART)


def invalid_topic(err: KafkaError, topic: object) -> KafkaError | None:
    """An unknown-topic error for a name Kafka can never accept ('bad topic!', a row written by
    SQL past the tracker's checks), as the permanent TOPIC_EXCEPTION it is: librdkafka reports
    such a name as merely unknown, which alone is retried for ever (a topic not yet created)."""
    if err.code() in _UNKNOWN_TOPIC and topic is not None and not is_topic_name(topic):
        return KafkaError(KafkaError.TOPIC_EXCEPTION, f"{str(topic)[:300]!r} is not a Kafka topic name")
    return None


# The produce-latency histogram takes about one sample per 64 records reported (a run's report
# counts its records): observe() per record costs too much.
SAMPLE_EVERY = 64
# Reports wait up to SETTLE_EVERY seconds, or until a purge batch of them is queued, and are then
# settled together. A poll serves the reports of one produce request, a slice of each partition's
# records: settled at once, each purge was a few hundred ids interleaved with other partitions'
# (one index probe per id). Gathered for a while, the reports of all partitions cover whole id
# stretches, purged by range (harvester.publishing.outbox_sql.runs_of) in fewer statements:
# 200,000 pre-filled rows here, ~390 purges with 10-25% of the rows by range -> ~50-130 purges
# with 50-90% by range, ~10% less reaper CPU a record. The price: a delivered row stays in the
# outbox up to this much longer (republished if the leader dies meanwhile: a duplicate, never
# a loss), and counts as in flight meanwhile (harvester.max_in_flight). Only while more reports
# are on their way: once every record in flight has reported, they are settled at once.
SETTLE_EVERY = 0.1

Report = tuple  # (row_id, leader_id, KafkaError | None)
# A run's report failed with an error that concerns one record alone (PERMANENT_DELIVERY): which of
# its records Kafka refuses is unknown, so the run is reset whole and its rows published again
# with a report each (DeliverySettler.single), which quarantines the one refused with its reason.
RUN_REFUSED = "a record of the run was refused for good; its rows are published again one report each"
_ROW_ID = itemgetter(0)
_LEADER = itemgetter(1)
_ERROR = itemgetter(2)


def error_reason(err: KafkaError) -> str:
    """What goes to the dead table and the log: the error's name and librdkafka's text, no payload."""
    return f"{err.name()}: {err.str()}"


def logs_safe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {redact_dsn(str(exc))}"


class DeliverySettler:
    def __init__(
        self,
        store: StoreLike,
        metrics: MetricsLike,
        *,
        batch: int = 5000,
        workers: int = 2,
        on_failure: Callable[[str], None] = lambda why: None,
        on_fatal: Callable[[], None] = lambda: None,
        limits: TopicLimits | None = None,
    ) -> None:
        self._store, self._m, self._batch = store, metrics, batch
        self._limits = limits  # topics' max.message.bytes, asked once a record is refused for its size
        self._size_lines = logs.Repeats(60.0)
        # Topics of reports refused for their size: added on the thread serving the reports, taken
        # by a settling thread, which asks for the topic's limit (set operations hold the GIL).
        self._oversized: set[str] = set()
        self._on_failure, self._on_fatal = on_failure, on_fatal
        self._log = logs.get("reaper.settle")
        self.reports: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._cond = threading.Condition()  # guards the in-flight count
        self._in_flight = 0
        self._counts = threading.Lock()  # guards the counters below
        self.delivered = 0  # records acknowledged by Kafka
        self.purged_rows = 0  # rows deleted (read by the leader's vacuum upkeep)
        self.dead_rows = 0  # rows moved to the dead table
        self._sampled = 0  # only the thread serving the producer's callbacks touches it
        # Row ids to publish with a report each (see RUN_REFUSED), each with the monotonic time it
        # is forgotten at (alone_for seconds on): added by the thread serving the callbacks, taken
        # out by the producing thread (dict operations hold the GIL).
        self.single: dict[int, float] = {}
        self.alone_for = ALONE_FOR
        # Told the topic of a record failed as unknown (its name valid): the strategy holds that
        # topic's rows back (harvester.publishing.missing_topics).
        self.missing_topic: Callable[[str], None] = lambda topic: None
        self._stop = threading.Event()
        self._threads = [logs.unit_thread(self._loop, f"reaper-settle-{i}") for i in range(workers)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float) -> None:
        """Settle what is queued, then stop the workers."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)

    # ------------------------------------------------------------------ the throttle's count

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def reserve(self, n: int) -> None:
        with self._cond:
            self._in_flight += n
        self._m.in_flight.set(self._in_flight)

    def release(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n
            self._cond.notify_all()
        self._m.in_flight.set(self._in_flight)

    def wait_below(self, limit: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight < limit, timeout)

    def drain(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    @property
    def progress(self) -> int:
        """Grows whenever a record is settled for good (acknowledged or quarantined)."""
        with self._counts:
            return self.delivered + self.dead_rows

    # ------------------------------------------------------------------ reports in

    def sample(self, msg) -> None:
        self._sampled += 1
        if self._sampled >= SAMPLE_EVERY:
            self._sample_now(msg)

    def _sample_now(self, msg) -> None:
        self._sampled = 0
        lat = msg.latency()
        if lat is not None:
            self._m.produce_duration.observe(lat)

    def report(self, row_id: int, leader_id: uuid.UUID, err: KafkaError | None, msg) -> None:
        """A delivery report (the producer's per-record callback). Called once per record from the
        thread serving the producer: `sample` is inlined, and the wake-up test reads a local."""
        reports = self.reports
        if err is None:
            reports.append((row_id, leader_id, err))
            self._sampled += 1
            if self._sampled >= SAMPLE_EVERY:
                self._sample_now(msg)
        else:
            err = invalid_topic(err, msg.topic() if msg is not None else None) or err
            if err.code() in _UNKNOWN_TOPIC and msg is not None:
                self.missing_topic(msg.topic())
            self.failed_report(err, msg)
            reports.append((row_id, leader_id, err))
        if len(reports) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def report_run(self, row_ids: list[int], leader_id: uuid.UUID, err: KafkaError | None, msg) -> None:
        """The delivery report of a run's last record, standing for every record of the run
        (harvester.publishing.runs): delivered, all were; failed, none is purged."""
        reports = self.reports
        if err is None:
            reports.extend(zip(row_ids, repeat(leader_id), repeat(None)))
            self._sampled += len(row_ids)
            if self._sampled >= SAMPLE_EVERY:
                self._sample_now(msg)
        else:
            err = invalid_topic(err, msg.topic() if msg is not None else None) or err
            if err.code() in _UNKNOWN_TOPIC and msg is not None:
                self.missing_topic(msg.topic())
            if err.code() in PERMANENT_DELIVERY and not err.fatal():
                self.single.update(dict.fromkeys(row_ids, time.monotonic() + self.alone_for))
                err = KafkaError(KafkaError._FAIL, f"{err.name()}: {RUN_REFUSED}")
            reports.extend(zip(row_ids, repeat(leader_id), repeat(err)))
            self.failed_report(err, msg)
        if len(reports) >= self._batch and not self._wake.is_set():
            self._wake.set()

    def produce_refused(self) -> None:
        """produce() refused a record for a passing reason; it is produced again in place."""
        self._m.produce_errors.inc()

    def remark(self, why: str) -> None:
        """Have the marker mark again from the head under a new leader id."""
        self._on_failure(why)

    def uncovered(self, n: int) -> None:
        """`n` records were handed over with no report to come (their run was cut short): their
        rows stay marked, and a remark publishes them again."""
        self._on_failure(f"{n} records handed over without a delivery report to come")

    def failed_report(self, err: KafkaError, msg=None) -> None:
        """What a failed delivery report sets off at once (its row is settled later)."""
        code = err.code()
        if code == KafkaError.MSG_SIZE_TOO_LARGE and msg is not None:
            self._oversized.add(msg.topic())
        if code in _PURGED:
            # Purged by us (retire, close): the leadership or producer they belonged to is
            # already gone; the report only resets the row under the old id. A remark here
            # would disturb the next leadership for nothing.
            pass
        elif code in PERMANENT_DELIVERY and not err.fatal():
            # Settled by quarantine and counted in records_dead_total only.
            pass
        else:
            self._m.produce_errors.inc()
            if err.fatal() or code == KafkaError._FATAL:
                self._on_fatal()
            self._on_failure(f"delivery failed: {err.str()}")

    def file(self, reports: list[Report]) -> None:
        """Reports settled together (a committed transaction's)."""
        self.reports.extend(reports)
        self._wake.set()

    def wake_if_pending(self) -> None:
        """After every poll: a worker is woken once a purge batch is queued (see SETTLE_EVERY), or
        once every record counted in flight has reported: nothing more is on its way to gather
        (light traffic, the end of a backlog), so those rows are settled without waiting."""
        n = len(self.reports)
        if n and (n >= self._batch or n >= self._in_flight) and not self._wake.is_set():
            self._wake.set()

    def dead(self, n: int, ids: list[int], reason: str) -> None:
        with self._counts:
            self.dead_rows += n
        self._m.dead.inc(n)
        self._log.error(
            "outbox rows Kafka will never accept moved to the dead table", row_ids=ids, reason=reason, moved=n
        )

    # ------------------------------------------------------------------ settling

    def _take(self) -> list[Report]:
        out: list[Report] = []
        reports, n = self.reports, self._batch
        try:
            while len(out) < n:
                out.append(reports.popleft())
        except IndexError:
            pass
        return out

    def _loop(self) -> None:
        while not self._stop.is_set() or self.reports:
            self._wake.wait(SETTLE_EVERY)
            self._wake.clear()
            while batch := self._take():
                if len(self.reports) >= self._batch:
                    self._wake.set()  # let another worker take the next batch meanwhile
                self._settle(batch)

    def _settle(self, batch: list[Report]) -> None:
        while self._oversized:
            try:
                topic = self._oversized.pop()
            except KeyError:  # the other settling thread took it
                break
            self._advise_size(topic)
        done: dict[uuid.UUID, list[int]] = {}
        try:
            self._apply(done, batch)
        finally:
            self.release(len(batch))

    def _apply(self, done: dict[uuid.UUID, list[int]], batch: list[Report]) -> None:
        """Purge `done` (delivered rows by leader id) and the delivered rows of `batch`; reset its
        failed rows, quarantine those Kafka can never accept."""
        failed: dict[uuid.UUID, list[int]] = {}
        dead: dict[tuple[uuid.UUID, str], list[int]] = {}
        first = batch[0][1] if batch else None
        if (
            first is not None
            and not done
            and all(map(is_, map(_ERROR, batch), repeat(None)))
            and all(map(is_, map(_LEADER, batch), repeat(first)))
        ):
            # The common case, every report a delivery under one leader id (the same object: the
            # producing thread passes one to every report of a mark): checked and the ids taken at
            # C speed (map, itemgetter, is_), not a Python iteration per report. (No == here: a
            # KafkaError refuses to be compared with None.)
            done[first] = list(map(_ROW_ID, batch))
            batch = []
        for row_id, leader_id, err in batch:
            if err is None:
                done.setdefault(leader_id, []).append(row_id)
            elif err.code() in PERMANENT_DELIVERY and not err.fatal():
                dead.setdefault((leader_id, error_reason(err)), []).append(row_id)
            else:
                failed.setdefault(leader_id, []).append(row_id)
        for leader_id, all_ids in done.items():
            for at in range(0, len(all_ids), self._batch):
                ids = all_ids[at : at + self._batch]
                self._m.published.inc(len(ids))
                with self._counts:
                    self.delivered += len(ids)
                started = time.perf_counter()
                try:
                    n = self._store.purge(leader_id, ids)
                except Exception as exc:
                    self._failed_db("purge", exc)
                    continue
                self._m.purge_duration.observe(time.perf_counter() - started)
                self._m.purged.inc(n)
                with self._counts:
                    self.purged_rows += n
                if n < len(ids):  # remarked under a newer id meanwhile: that copy purges them
                    self._log.debug("purge hit fewer rows", wanted=len(ids), purged=n)
        for leader_id, ids in failed.items():
            try:
                n = self._store.reset(leader_id, ids)
            except Exception as exc:
                self._failed_db("reset", exc)
                continue
            self._m.reset.inc(n)
        for (leader_id, reason), ids in dead.items():
            try:
                n = self._store.quarantine(leader_id, ids, reason)
            except Exception as exc:
                self._failed_db("quarantine", exc)  # still marked: found again, refused again
                continue
            if n:
                self.dead(n, ids, reason)

    def _advise_size(self, topic: str) -> None:
        """A record of `topic` refused for its size: published again until the topic takes it. Once
        a minute per topic, an error line with the topic's limit and what to set."""
        if not self._size_lines.due(topic):
            return
        limit = self._limits.of(topic) if self._limits is not None else None
        self._log.error(
            "the brokers refused a batch as larger than its topic's max.message.bytes: its rows are "
            "published again until the topic takes them; set kafka.producer.message.max.bytes below "
            "that limit (leaving about 1 KB for a batch's framing) to have larger records moved to "
            "the dead table as soon as they are produced, or raise the topic's limit",
            topic=topic,
            max_message_bytes=limit,
            producer_message_max_bytes=self._limits.producer_limit if self._limits is not None else None,
        )

    def _failed_db(self, what: str, exc: Exception) -> None:
        # The rows stay marked by an old id; the remark that follows publishes them again.
        self._log.warning(f"{what} failed", error=logs_safe(exc))
        self._on_failure(f"{what} failed")
