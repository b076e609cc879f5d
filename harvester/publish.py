"""The data producer and its delivery reports, settled by batched purges and resets.

The producer is idempotent with an infinite message timeout and librdkafka's gapless guarantee:
within a partition a record is never written after an earlier one failed, so after any failure
remarking from the head of the outbox restores per-key order without a one-in-flight-per-key
barrier. Delivery reports land in a queue; `purge_workers` threads, each on its own database
connection, delete delivered rows (and unmark failed ones) in batches. A record counts as in flight
from produce() until its report is settled in the database, which is what the throttle bounds.

A record Kafka can never accept (see PERMANENT_PRODUCE and PERMANENT_DELIVERY) is not retried: its
row is moved to the dead table, atomically and only while still marked by the same leader id, so
one bad row cannot hold up every row behind it. Batch-level or possibly temporary refusals are
retried through the usual remark (with back-off): quarantining them could bury good rows.

On fence or revocation the producer is retired: everything queued AND in flight is purged and a new
producer takes its place, so the old leadership has nothing left that librdkafka could retry later.

With a `transactional.id` (harvester.transactional_id) every produce_rows call is one Kafka transaction.
The producer of a new leadership calls init_transactions() before its first record, which makes the
broker fence every older producer of that id: a paused old leader that resumes can write nothing
more (what it wrote in its open transaction is aborted). Delivered records are purged only once
their transaction commits; an aborted transaction leaves its rows marked by an old leader id, and
the remark that follows publishes them again.
"""
from __future__ import annotations

import collections
import threading
import time
import uuid
from functools import partial
from typing import Any, Callable

from confluent_kafka import KafkaError, KafkaException, Producer

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
# Reconnection after a broker restart: librdkafka's default back-off grows to 10 s between attempts,
# so a producer could sit idle for seconds after the broker answers again. 1 s bounds that wait at
# the cost of at most one connection attempt a second per broker while it is gone. NELI's clients
# use the same bound (harvester.neli).
RECONNECT = {"reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 1000}
DEFAULT_PRODUCER.update(RECONNECT)
_PURGED = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)

# produce() refusals that are about the record itself and can never succeed, however often retried:
# larger than message.max.bytes, an explicit partition the topic does not have, an invalid argument
# or topic name.
PERMANENT_PRODUCE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError._UNKNOWN_PARTITION, KafkaError._INVALID_ARG,
                               KafkaError.TOPIC_EXCEPTION})
# Delivery-report errors that concern this record alone and can never succeed. Deliberately NOT here:
# - MSG_SIZE_TOO_LARGE, INVALID_RECORD, RECORD_LIST_TOO_LARGE from the broker: they fail a whole
#   batch, and quarantining would bury the good records that shared it (a record above the
#   client's message.max.bytes is refused by produce() already, caught above);
# - TOPIC_AUTHORIZATION_FAILED, _UNKNOWN_TOPIC, UNKNOWN_TOPIC_OR_PART: an ACL or a topic not yet
#   created (brokers here do not auto-create) is an operator's fix away; quarantining would move
#   every row of that topic out of the outbox. They are retried, with the remark back-off.
PERMANENT_DELIVERY = frozenset({KafkaError._UNKNOWN_PARTITION, KafkaError._INVALID_ARG, KafkaError.TOPIC_EXCEPTION})


class QuarantineError(RuntimeError):
    """A row that Kafka refused for good could not be moved to the dead table (database error or
    the row is no longer marked by this leader id): stop producing and remark."""

    def __init__(self, row_id: int, reason: str, detail: str) -> None:
        self.row_id, self.reason = row_id, reason
        super().__init__(f"outbox row {row_id} ({reason}) was not quarantined: {detail}")


def error_reason(err: KafkaError) -> str:
    """What goes to the dead table and the log: the error's name and librdkafka's text, no payload."""
    return f"{err.name()}: {err.str()}"
TXN_INIT_TIMEOUT = 30.0    # init_transactions waits for the fenced producer's transaction to be aborted
TXN_COMMIT_TIMEOUT = 30.0   # also bounds the wait for a transaction's last acknowledgements
TXN_ABORT_TIMEOUT = 10.0
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
        self.dead_rows = 0    # rows moved to the dead table
        self.retired = 0      # producers retired (fence, revocation, fatal error)
        self._swap = threading.Lock()  # held across each produce(): a retired producer never gets another record
        self._stop = threading.Event()
        self._retiring: list = []  # replaced producers whose last reports the poll thread still serves
        self.broken = False  # a fatal producer error: replace the producer before producing again
        # Transactions (see the module docstring). Only the producing thread begins, commits and
        # aborts; the poll thread's reports file delivered records under the transaction they belong to.
        self.transactional = "transactional.id" in conf
        self._txn_lock = threading.Lock()
        self._txn_seq = 0             # the open (or next) transaction; bumped whenever one is settled
        self._txn_delivered: list[tuple] = []  # reports of the open transaction, purged once it commits
        self._txn_failed = False      # a record of the open transaction failed: it can only abort
        self._txn_ready = None        # the producer init_transactions() ran on
        self._txn_open = None         # the producer with an open transaction
        self._serving = threading.Lock()  # held by whichever thread serves the producer's callbacks
        self._polls_held = threading.Event()  # an abort waits for `_serving`: the poll thread stands aside
        self.txn_committed = self.txn_aborted = 0
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
        producer, report, clock, swap = self.producer, self._report, time.monotonic, self._swap
        sent = dead = 0
        try:
            deadline = valid_until()
            if self.transactional:
                seq = self._begin(producer, still_valid, valid_until)
                if seq is None:
                    return 0  # the finally clause releases the batch
                report = partial(self._report_txn, seq)
            for i, row in enumerate(rows):
                if clock() >= deadline or (i & 255 == 0 and not still_valid()):
                    break
                row_id, topic, key, value, hkeys, hvals, partition = row
                # Positional, in the order of confluent-kafka's produce(topic, value, key, partition,
                # callback, on_delivery, timestamp, headers): keywords cost ~1 µs a record here.
                args = (topic, value, key, -1 if partition is None else partition, partial(report, row_id, leader_id),
                        None, 0, list(zip(hkeys, hvals)) if hkeys else None)
                try:
                    with swap:
                        if self.producer is not producer:
                            break  # retired (fence, revocation): not one more record into it
                        producer.produce(*args)
                except BufferError:
                    # The local queue is full: nothing after this record was enqueued either, so
                    # waiting and retrying the same record keeps the order. Give up at the deadline.
                    self.queue_full_waits += 1
                    give_up = min(deadline, clock() + self.queue_full_patience)
                    retired = False
                    while True:
                        time.sleep(0.001)
                        try:
                            with swap:
                                if self.producer is not producer:
                                    retired = True
                                    break
                                producer.produce(*args)
                            break
                        except BufferError:
                            if clock() >= give_up or not still_valid():
                                raise
                    if retired:
                        break
                except KafkaException as exc:
                    err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                    if err is None or err.code() not in PERMANENT_PRODUCE:
                        raise
                    # Never acceptable: move it aside (or stop here if that fails, so nothing of
                    # its key overtakes it) and carry on with the next record.
                    self._quarantine_now(leader_id, row_id, error_reason(err))
                    dead += 1
                    continue
                sent += 1
                if sent & 255 == 0:
                    deadline = valid_until()
        except BaseException:
            if self.transactional and self._txn_open is producer:
                # librdkafka may already refuse every record of this transaction (an abortable
                # error): it can only be aborted, which _finish does below.
                self._txn_failed = True
            raise
        finally:
            self.produced += sent
            if sent < len(rows):
                self.release(len(rows) - sent)  # includes the quarantined rows: settled here
            if self.transactional and self._txn_open is producer:
                self._finish(producer, valid_until)
        return sent

    # ------------------------------------------------------------------ transactions

    def _begin(self, producer, still_valid: Callable[[], bool], valid_until: Callable[[], float]) -> int | None:
        """Open a transaction on `producer` and return its sequence number for the delivery
        reports; None (produce nothing) when leadership or the producer is gone.

        The first use of a producer calls init_transactions(), which fences every older producer
        of the id. It runs only while leading, with a timeout bounded by what is left of the
        leadership; the check after it only stops producing (the fence, if it happened, stands).
        """
        clock = time.monotonic
        if clock() >= valid_until() or not still_valid():
            return None
        if self._txn_ready is not producer:
            left = min(TXN_INIT_TIMEOUT, valid_until() - clock())
            if left <= 0:
                return None
            producer.init_transactions(left)
            self._txn_ready = producer  # a second init on it would fail ("not valid in state Ready")
            if self.producer is not producer or clock() >= valid_until() or not still_valid():
                return None
        producer.begin_transaction()
        with self._txn_lock:
            self._txn_failed = False
            self._txn_open = producer
        return self._txn_seq

    def _finish(self, producer, valid_until: Callable[[], float]) -> None:
        """Settle the open transaction, always, before produce_rows returns: commit it once every
        record has its delivery report and purge its rows; or abort it and leave its rows to a
        remark, when a record failed, the commit failed, the leadership deadline passed or the
        records were not all acknowledged within TXN_COMMIT_TIMEOUT (an abort exposes nothing, so
        it needs no leadership).

        Only one thread at a time may serve a producer's callbacks. A commit runs once every
        report has been served by the poll thread, so its internal flush finds nothing to serve.
        An abort purges what is still queued and its flush serves those reports (as purged) while
        it waits, up to TXN_ABORT_TIMEOUT, for the requests already sent: it runs holding
        `_serving`, which the poll thread holds around every poll. If the producer was retired, the
        retirement already dropped the transaction: it is left to the next leader's
        init_transactions to abort.
        """
        give_up = time.monotonic() + TXN_COMMIT_TIMEOUT
        # A failed transaction keeps its queued records until it is aborted: no use waiting.
        while len(producer) and not self._txn_failed and self.producer is producer \
                and time.monotonic() < min(give_up, valid_until()):
            time.sleep(0.0005)
        if self.producer is not producer:
            return
        if self._txn_failed:
            why = "a record of the transaction failed"
        elif len(producer) or time.monotonic() >= valid_until():
            why = "not acknowledged within the leadership or TXN_COMMIT_TIMEOUT"
        else:
            started = time.perf_counter()
            try:
                producer.commit_transaction(TXN_COMMIT_TIMEOUT)  # nothing left to serve: no `_serving`
            except KafkaException as exc:
                self._log.warning("transaction commit failed", error=str(exc))
                why = "commit failed"
            else:
                with self._txn_lock:
                    done, self._txn_delivered = self._txn_delivered, []
                    self._txn_seq += 1
                    self._txn_open = None
                self.txn_committed += 1
                self._m.txn_duration.observe(time.perf_counter() - started)
                self._reports.extend(done)
                self._wake.set()
                return
        self._abort(producer, why)

    def _abort(self, producer, why: str) -> None:
        """Abort the open transaction and raise a remark before returning, even when the failure
        that caused it raised one already (the poll thread may not have yet): no further batch
        marked under this leader id may be produced. Its rows would be committed while the aborted
        rows before them, still marked by the same id, wait: a key would go backwards."""
        self._drop_transaction()
        self.txn_aborted += 1
        self._m.txn_aborted.inc()
        self._log.info("transaction aborted", reason=why)
        self._polls_held.set()  # else the poll thread, re-taking `_serving` at once, could starve this
        try:
            with self._serving:
                producer.abort_transaction(TXN_ABORT_TIMEOUT)
        except KafkaException as exc:  # fenced, fatal or timed out: replace the producer
            self._log.warning("transaction abort failed", error=str(exc))
            self.broken = True
        finally:
            self._polls_held.clear()
        self._on_failure(f"transaction aborted: {why}")

    def _drop_transaction(self) -> None:
        """Forget the open transaction: its delivered rows stay marked (republished after a remark)."""
        with self._txn_lock:
            dropped, self._txn_delivered = self._txn_delivered, []
            self._txn_seq += 1
            self._txn_open = None
        if dropped:
            self.release(len(dropped))

    def _report_txn(self, seq: int, row_id: int, leader_id: uuid.UUID, err, msg) -> None:
        if err is None:
            self._sample(msg)
            with self._txn_lock:
                if seq == self._txn_seq:
                    self._txn_delivered.append((row_id, leader_id, None))
                    return
            self.release(1)  # its transaction was already dropped: the row is republished
            return
        with self._txn_lock:
            if seq == self._txn_seq:
                self._txn_failed = True  # _finish aborts it (and raises the remark)
        self._report(row_id, leader_id, err, msg)  # reset (or quarantine), as without transactions

    def _quarantine_now(self, leader_id: uuid.UUID, row_id: int, reason: str) -> None:
        try:
            n = self._store.quarantine(leader_id, [row_id], reason)
        except Exception as exc:
            raise QuarantineError(row_id, reason, logs_safe(exc)) from exc
        if n != 1:
            raise QuarantineError(row_id, reason, "no longer marked by this leader id")
        self._dead(n, [row_id], reason)

    def _dead(self, n: int, ids: list[int], reason: str) -> None:
        self.dead_rows += n
        self._m.dead.inc(n)
        self._log.error("outbox rows Kafka will never accept moved to the dead table", row_ids=ids, reason=reason,
                        moved=n)

    @property
    def progress(self) -> int:
        """Grows whenever a record is settled for good (acknowledged or quarantined)."""
        return self.delivered + self.dead_rows

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

    def retire_producer(self, why: str) -> None:
        """Swap the producer for a new one; purge everything the old one holds, queued and in flight.

        Used on fence and revocation (nothing of the old leadership may be sent or retried later:
        with message.timeout.ms=0 an in-flight record would otherwise be retried for ever, and
        could land after the next leader's records of its key) and after a fatal error. Once the
        swap is done no produce() reaches the old producer (produce_rows checks under `_swap`).
        The purged records' reports (_PURGE_QUEUE/_PURGE_INFLIGHT) reset their rows, guarded by
        the old leader id, and force no remark. The old producer is left to the poll thread, which
        serves those reports: only that thread ever serves callbacks, since serving one producer's
        callbacks from two threads at once (flush here, poll there) was seen to deadlock.
        Residual: a produce request already on the wire may still be written by the broker.
        """
        new = self._new_producer()
        with self._swap:
            old, self.producer = self.producer, new
            self.broken = False
        if self.transactional:
            self._drop_transaction()  # never committed now; the next leader's init aborts it
        try:
            old.purge(in_queue=True, in_flight=True)
        except Exception as exc:  # a broken producer may refuse; it gets no new record either way
            self._log.warning("purging the retired producer failed", error=str(exc))
        with self._cond:
            self._retiring.append(old)
        self.retired += 1
        self._log.warning("producer retired and replaced", reason=why)

    def replace_if_broken(self) -> bool:
        """Swap a producer that hit a fatal error for a new one (see retire_producer)."""
        if not self.broken:
            return False
        self.retire_producer("fatal producer error")
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

    def _sample(self, msg) -> None:
        self._sampled += 1
        if self._sampled >= SAMPLE_EVERY:
            self._sampled = 0
            lat = msg.latency()
            if lat is not None:
                self._m.produce_duration.observe(lat)

    def _report(self, row_id: int, leader_id: uuid.UUID, err, msg) -> None:
        self._reports.append((row_id, leader_id, err))
        if err is None:
            self._sample(msg)
        else:
            code = err.code()
            if code in _PURGED:
                # Purged by us (retire, close): the leadership or producer they belonged to is
                # already gone; the report only resets the row under the old id. A remark here
                # would disturb the next leadership for nothing.
                pass
            elif code in PERMANENT_DELIVERY and not err.fatal():
                # Settled by quarantine and counted in records_dead_total, as when produce() itself
                # refuses the record: which of the two happens depends only on metadata timing.
                pass
            else:
                self._m.produce_errors.inc()
                if err.fatal() or code == KafkaError._FATAL:
                    self.broken = True
                self._on_failure(f"delivery failed: {err.str()}")
        if len(self._reports) >= 512 and not self._wake.is_set():  # set() takes a lock: not per record
            self._wake.set()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            if self._polls_held.is_set():
                time.sleep(0.001)
                continue
            try:
                with self._serving:
                    self.producer.poll(0.02)
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
        dead: dict[tuple[uuid.UUID, str], list[int]] = {}
        for row_id, leader_id, err in batch:
            if err is None:
                done.setdefault(leader_id, []).append(row_id)
            elif err.code() in PERMANENT_DELIVERY and not err.fatal():
                dead.setdefault((leader_id, error_reason(err)), []).append(row_id)
            else:
                failed.setdefault(leader_id, []).append(row_id)
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
            for (leader_id, reason), ids in dead.items():
                try:
                    n = self._store.quarantine(leader_id, ids, reason)
                except Exception as exc:
                    self._failed_db("quarantine", exc)  # still marked: found again, refused again
                    continue
                if n:
                    self._dead(n, ids, reason)
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
