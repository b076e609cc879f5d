"""The data producer and its delivery reports, settled by batched purges and resets.

The producer is idempotent with an infinite message timeout and librdkafka's gapless guarantee:
within a partition a record is never written after an earlier one failed, so after any failure
remarking from the head of the outbox restores per-key order without a one-in-flight-per-key
barrier. Delivery reports land in a queue; `purge_workers` threads, each on its own database
connection, delete delivered rows (and unmark failed ones) in batches. A record counts as in flight
from produce() until its report is settled in the database, which is what the throttle bounds.
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from functools import partial
from typing import Any, Callable

from confluent_kafka import KafkaError, Producer

from . import logs
from .faults import FaultPlan, FaultyProducer
from .metrics import HarvesterMetrics

from .config import REQUIRED_PRODUCER  # noqa: E402  (settings the ordering argument rests on)

DEFAULT_PRODUCER = {
    "linger.ms": 2,
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 1_048_576,
    "compression.type": "lz4",
    "log_level": 4,
}
_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)
SAMPLE_EVERY = 64  # produce-latency histogram samples 1 in 64 reports: observe() per record costs too much


def producer_config(bootstrap: str, client: dict, producer: dict) -> dict:
    conf = {"bootstrap.servers": bootstrap, **DEFAULT_PRODUCER, **client, **producer}
    for key, value in REQUIRED_PRODUCER.items():
        if key in conf and str(conf[key]).lower() != str(value).lower():
            raise ValueError(f"kafka producer setting {key}={conf[key]!r} is not allowed: reaper needs {value!r} "
                             "to keep per-key order across failures")
    conf.update(REQUIRED_PRODUCER)
    return conf


class Publisher:
    def __init__(self, conf: dict, store: Any, metrics: HarvesterMetrics, *, purge_batch: int = 5000,
                 purge_workers: int = 2, faults: FaultPlan | None = None,
                 on_failure: Callable[[str], None] = lambda why: None) -> None:
        self._conf, self._store, self._m = conf, store, metrics
        self._purge_batch, self._faults, self._on_failure = purge_batch, faults, on_failure
        self._log = logs.get("reaper.publish")
        self._reports: collections.deque = collections.deque()   # (row_id, leader_id, err or None)
        self._wake = threading.Event()
        self._cond = threading.Condition()
        self._in_flight = 0
        self._sampled = 0
        self.purged_rows = 0  # read by the leader's vacuum upkeep
        self.queue_full_waits = 0  # produce() found the local queue full and waited
        self.queue_full_patience = 1.0
        self.delivered = 0    # records acknowledged by Kafka
        self.produced = 0     # records handed to the producer by this process (logged on state changes)
        self._stop = threading.Event()
        self._retiring: list = []  # replaced producers whose last reports the poll thread still serves
        self.broken = False  # a fatal producer error: replace the producer before producing again
        self.producer = self._new_producer()
        self._threads = [threading.Thread(target=self._poll_loop, name="reaper-poll", daemon=True)]
        self._threads += [threading.Thread(target=self._settle_loop, name=f"reaper-settle-{i}", daemon=True)
                          for i in range(purge_workers)]

    def _new_producer(self):
        conf = dict(self._conf)
        conf["error_cb"] = self._on_error
        conf.setdefault("logger", logs.KafkaLogger("producer"))
        p = Producer(conf)
        return FaultyProducer(p, self._faults) if self._faults is not None else p

    def start(self) -> "Publisher":
        for t in self._threads:
            t.start()
        return self

    # ------------------------------------------------------------------ producing

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def produce_rows(self, rows: list[tuple], leader_id: uuid.UUID, still_valid: Callable[[], bool],
                     valid_until: Callable[[], float]) -> int:
        """Produce marked rows in id order; stop at the first local error (raised) or once no longer valid.

        The leadership deadline (last heartbeat + heartbeat_timeout) is checked before every record,
        so a process resumed after a pause produces nothing more. Returns how many were handed to
        the producer; rows not handed over stay marked by an old id and are found by the next mark.
        """
        producer, report, clock = self.producer, self._report, time.monotonic
        sent = 0
        try:
            deadline = valid_until()
            for row in rows:
                if clock() >= deadline or (sent & 255 == 0 and not still_valid()):
                    break
                row_id, topic, key, value, hkeys, hvals, partition = row
                args = dict(value=value, key=key, partition=-1 if partition is None else partition,
                            headers=list(zip(hkeys, hvals)) if hkeys else None,
                            on_delivery=partial(report, row_id, leader_id))
                try:
                    producer.produce(topic, **args)
                except BufferError:
                    # The local queue is full: nothing after this record was enqueued either, so
                    # waiting and retrying the same record keeps the order. Give up at the deadline.
                    self.queue_full_waits += 1
                    give_up = min(deadline, clock() + self.queue_full_patience)
                    while True:
                        time.sleep(0.001)
                        try:
                            producer.produce(topic, **args)
                            break
                        except BufferError:
                            if clock() >= give_up or not still_valid():
                                raise
                sent += 1
                if sent & 255 == 0:
                    deadline = valid_until()
        finally:
            self.produced += sent
            if sent < len(rows):
                self.release(len(rows) - sent)
        return sent

    def reserve(self, n: int) -> None:
        """Count marked rows as in flight (the throttle) before they are produced."""
        with self._cond:
            self._in_flight += n
        self._m.in_flight.set(self._in_flight)

    def release(self, n: int) -> None:
        """Reserved rows that will not be produced (dropped batch or stopped part-way)."""
        self._settled(n)

    def wait_below(self, limit: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._in_flight < limit, timeout)

    def drop_queued(self) -> None:
        """Fence: drop records not yet sent. Their reports (purged) unmark them."""
        try:
            self.producer.purge(in_queue=True, in_flight=False)
        except Exception as exc:  # a broken producer may refuse; replacing it drops everything anyway
            self._log.warning("producer purge failed", error=str(exc))

    def replace_if_broken(self) -> bool:
        """Swap a producer that hit a fatal error for a new one.

        The old one is purged and left to the poll thread, which serves its remaining (failed)
        reports: only that thread ever serves callbacks, since serving one producer's callbacks
        from two threads at once (flush here, poll there) was seen to deadlock.
        """
        if not self.broken:
            return False
        old = self.producer
        self.producer = self._new_producer()
        self.broken = False
        try:
            old.purge(in_queue=True, in_flight=True)
        except Exception as exc:
            self._log.warning("purging the broken producer failed", error=str(exc))
        with self._cond:
            self._retiring.append(old)
        self._log.warning("producer replaced after a fatal error")
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every record in flight is settled; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._in_flight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Drop whatever is still queued, serve the last reports, stop the threads."""
        try:
            self.producer.purge(in_queue=True, in_flight=True)
        except Exception:
            pass
        deadline = time.monotonic() + min(timeout, 2.0)
        while (len(self.producer) or self._retiring) and time.monotonic() < deadline:
            time.sleep(0.01)  # the poll thread serves the purged reports
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout)

    # ------------------------------------------------------------------ reports

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal():
            self.broken = True
            self._log.error("fatal producer error", error=str(err))
            self._on_failure("fatal producer error")
        else:
            self._log.info("producer client error", error=str(err))

    def _report(self, row_id: int, leader_id: uuid.UUID, err, msg) -> None:
        self._reports.append((row_id, leader_id, err))
        if err is None:
            self._sampled += 1
            if self._sampled >= SAMPLE_EVERY:
                self._sampled = 0
                lat = msg.latency()
                if lat is not None:
                    self._m.produce_duration.observe(lat)
        else:
            if err.code() not in _PURGED:
                self._m.produce_errors.inc()
            if err.fatal() or err.code() == KafkaError._FATAL:
                self.broken = True
            self._on_failure(f"delivery failed: {err.str()}")
        if len(self._reports) >= 512:
            self._wake.set()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.producer.poll(0.02)
                if self._retiring:
                    for old in list(self._retiring):
                        old.poll(0)
                        if len(old) == 0:
                            with self._cond:
                                self._retiring.remove(old)
            except Exception as exc:
                self._log.error("producer poll failed", error=str(exc))
                time.sleep(0.1)
            if self._reports:
                self._wake.set()

    def _take(self) -> list[tuple]:
        out, reports, n = [], self._reports, self._purge_batch
        try:
            while len(out) < n:
                out.append(reports.popleft())
        except IndexError:
            pass
        return out

    def _settle_loop(self) -> None:
        while not self._stop.is_set() or self._reports:
            self._wake.wait(0.02)
            self._wake.clear()
            while batch := self._take():
                if len(self._reports) >= 512:
                    self._wake.set()  # let another worker take the next batch meanwhile
                self._settle(batch)

    def _settle(self, batch: list[tuple]) -> None:
        done: dict[uuid.UUID, list[int]] = {}
        failed: dict[uuid.UUID, list[int]] = {}
        for row_id, leader_id, err in batch:
            (done if err is None else failed).setdefault(leader_id, []).append(row_id)
        try:
            for leader_id, ids in done.items():
                self._m.published.inc(len(ids))
                self.delivered += len(ids)
                started = time.perf_counter()
                try:
                    n = self._store.purge(leader_id, ids)
                except Exception as exc:
                    self._failed_db("purge", exc)
                    continue
                self._m.purge_duration.observe(time.perf_counter() - started)
                self._m.purged.inc(n)
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
        finally:
            self._settled(len(batch))

    def _failed_db(self, what: str, exc: Exception) -> None:
        # The rows stay marked by an old id; the remark that follows publishes them again (duplicates, no loss).
        self._log.warning(f"{what} failed", error=logs_safe(exc))
        self._on_failure(f"{what} failed")

    def _settled(self, n: int) -> None:
        with self._cond:
            self._in_flight -= n
            self._cond.notify_all()
        self._m.in_flight.set(self._in_flight)


def logs_safe(exc: BaseException) -> str:
    from .config import redact_dsn
    return f"{type(exc).__name__}: {redact_dsn(str(exc))}"
