"""The Kafka floor of fenced publishing, and where a fenced row's time goes (bench/harvest_latency.py).

Floor: what the broker and librdkafka alone cost at the offered rate, without Postgres or the
harvester. Records fall due as the latency benchmark's inserts commit (`chunk` at a time, `rate`
per second); each record's latency is from when it fell due to when Kafka acknowledged it:

  idempotent     one producer with the harvester's idempotent settings: produce what is due, its
                 delivery report is the acknowledgement
  transactional  the harvester's transactional settings: begin, produce everything due, commit
                 (commit_transaction flushes), the commit is the acknowledgement; then the next
                 transaction with whatever fell due meanwhile. `producers` > 1 takes them in turn
                 (as the harvester does), one transaction at a time.

Breakdown (`Phases`): timestamps taken around the harvester's own calls in the benchmark process
(its mark, its strategy's produce_rows and finish, its commit histogram), per row: inserted ->
mark starts -> mark returns -> produce_rows starts (the producing thread was busy with the
previous transaction until then) -> finish starts (begin + produce loop) -> finish returns (the
wait for every delivery report, then commit_transaction).
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
import zlib
from functools import partial
from typing import Any

from confluent_kafka import Producer

from harvester.publishing.publisher import producer_config
from tracker.message_ids import MESSAGE_ID_HEADER

VALUE = b"v" * 200


def _quantiles(lat: list[float]) -> dict[str, float]:
    q = statistics.quantiles(lat, n=100)
    return {"p50_ms": round(q[49] * 1000, 2), "p99_ms": round(q[98] * 1000, 2), "max_ms": round(max(lat) * 1000, 2)}


def _commit_figures(commits: list[float]) -> dict[str, Any]:
    """The count and the p50/p99 of commit_transaction's durations (seconds)."""
    c = statistics.quantiles(commits, n=100)
    return {
        "transactions": len(commits),
        "commit_p50_ms": round(c[49] * 1000, 2),
        "commit_p99_ms": round(c[98] * 1000, 2),
    }


def _record(i: int) -> tuple:
    return (b"key-%d" % (i % 1000), [(MESSAGE_ID_HEADER, b"bench:%d" % i)])


def bare(
    bootstrap: str, topic: str, seconds: float, rate: float, *, producers: int = 0, chunk: int = 10
) -> dict[str, Any]:
    """producers=0: idempotent; else that many transactional producers taken in turn."""
    txn = producers > 0
    base = f"bench-floor-{uuid.uuid4().hex[:8]}" if txn else ""
    made = []
    for i in range(max(1, producers)):
        conf = producer_config(bootstrap, {}, {}, base)
        if i:
            conf["transactional.id"] = f"{base}#{i}"
        made.append(Producer(conf))
    for p in made:
        if txn:
            p.init_transactions(30)
    due: dict[int, float] = {}
    acked: dict[int, float] = {}
    lock = threading.Lock()

    def report(i: int, err, msg) -> None:
        if err is None and not txn:
            with lock:
                acked[i] = time.perf_counter()

    # warm: one record (or transaction) through each producer first
    for p in made:
        if txn:
            p.begin_transaction()
        k, h = _record(-1)
        p.produce(topic, VALUE, k, headers=h)
        if txn:
            p.commit_transaction(30)
        else:
            p.flush(30)
    commits: list[float] = []
    sizes: list[int] = []
    started = time.perf_counter()
    sent, turn = 0, 0
    end = started + seconds
    while True:
        now = time.perf_counter()
        if now >= end and sent >= int((end - started) * rate):
            break
        n_due = min(int((now - started) * rate) // chunk * chunk, int(seconds * rate))
        if n_due <= sent:
            for p in made:
                p.poll(0)
            time.sleep(0.0005)
            continue
        p = made[turn % len(made)]
        turn += 1
        if txn:
            p.begin_transaction()
        ids = range(sent, n_due)
        for i in ids:
            due[i] = started + (i // chunk * chunk) / rate
            k, h = _record(i)
            p.produce(topic, VALUE, k, -1, partial(report, i), None, 0, h)
        sent = n_due
        if txn:
            t0 = time.perf_counter()
            p.commit_transaction(30)
            t1 = time.perf_counter()
            commits.append(t1 - t0)
            sizes.append(len(ids))
            for i in ids:
                acked[i] = t1
        else:
            p.poll(0)
    for p in made:
        p.flush(30)
    lat = [acked[i] - due[i] for i in due if i in acked]
    out: dict[str, Any] = {"mode": f"transactional x{producers}" if txn else "idempotent", "records": len(lat)}
    out.update(_quantiles(lat))
    if commits:
        out.update(_commit_figures(commits))
        out["records_per_transaction"] = round(sum(sizes) / len(sizes), 1)
    return out


def owned(
    bootstrap: str, topic: str, partitions: int, seconds: float, rate: float, *, owners: int = 2, chunk: int = 10
) -> dict[str, Any]:
    """A floor of a design the harvester does not use: `owners` transactional producers, each owning
    the partitions p with p % owners == its index, each in a thread of its own running one
    transaction after another with what fell due for its partitions. Transactions of different
    owners overlap; per partition (so per key) there is still one producer and one order. Records
    fall due as in bare(); the partition is the harvester's own (CRC-32 of the key, as librdkafka's
    default partitioner)."""
    base = f"bench-owned-{uuid.uuid4().hex[:8]}"
    total = int(seconds * rate)
    part = [zlib.crc32(_record(i)[0]) % partitions for i in range(total)]
    due: dict[int, float] = {}
    acked: dict[int, float] = {}
    commits: list[float] = []
    lock = threading.Lock()
    made = []
    for i in range(owners):
        conf = producer_config(bootstrap, {}, {}, f"{base}#{i}")
        producer = Producer(conf)
        producer.init_transactions(30)
        producer.begin_transaction()  # warm: one transaction through each first
        k, h = _record(-1)
        producer.produce(topic, VALUE, k, i % partitions, None, None, 0, h)
        producer.commit_transaction(30)
        made.append(producer)
    started = time.perf_counter()
    end = started + seconds

    def run(index: int, producer: Producer) -> None:
        sent = 0  # ids below this are taken (by this owner or skipped as another's)
        while True:
            now = time.perf_counter()
            if now >= end and sent >= total:
                return
            n_due = min(int((now - started) * rate) // chunk * chunk, total)
            mine = [i for i in range(sent, n_due) if part[i] % owners == index]
            sent = max(sent, n_due)
            if not mine:
                producer.poll(0)
                time.sleep(0.0005)
                continue
            producer.begin_transaction()
            for i in mine:
                k, h = _record(i)
                producer.produce(topic, VALUE, k, part[i], None, None, 0, h)
            t0 = time.perf_counter()
            producer.commit_transaction(30)
            t1 = time.perf_counter()
            with lock:
                commits.append(t1 - t0)
                for i in mine:
                    due[i] = started + (i // chunk * chunk) / rate
                    acked[i] = t1

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(made)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lat = [acked[i] - due[i] for i in due]
    out: dict[str, Any] = {"mode": f"transactional, {owners} owners of {partitions} partitions", "records": len(lat)}
    out.update(_quantiles(lat))
    out.update(_commit_figures(commits))
    return out


class Phases:
    """Timestamps around one unit's mark and produce calls (see the module's docstring)."""

    def __init__(self, unit, commit_seconds: list[float]) -> None:
        self.mark_at: dict[int, tuple[float, float]] = {}
        self.txn_at: dict[int, tuple[float, float, float, float]] = {}  # enter, finish, done, commit s
        self._commits = commit_seconds
        store, strategy = unit.store, unit.publisher.strategy
        mark, produce_rows = store.mark, strategy.produce_rows
        finish = getattr(strategy, "finish", None)
        current: dict[str, float] = {}

        def timed_mark(*a, **kw):
            t0 = time.time()
            rows = mark(*a, **kw)
            t1 = time.time()
            for r in rows:
                self.mark_at[r[0]] = (t0, t1)
            return rows

        def timed_produce(rows, *a, **kw):
            current.clear()
            t0 = time.time()
            try:
                return produce_rows(rows, *a, **kw)
            finally:
                t2 = time.time()
                stamp = (t0, current.get("finish", t2), current.get("done", t2), current.get("commit", 0.0))
                for r in rows:
                    self.txn_at.setdefault(r[0], stamp)

        def timed_finish(*a, **kw):
            current["finish"] = time.time()
            n = len(self._commits)
            try:
                return finish(*a, **kw)
            finally:
                current["done"] = time.time()
                if len(self._commits) > n:
                    current["commit"] = self._commits[-1]

        store.mark = timed_mark
        strategy.produce_rows = timed_produce
        if finish is not None:
            strategy.finish = timed_finish

    def breakdown(self, committed: dict[int, float], acked: dict[int, float]) -> dict[str, Any]:
        """Per phase (ms): the median over all rows, and the mean over the slowest 1% of rows."""
        rows = []
        for i, c in committed.items():
            if i not in acked or i not in self.mark_at or i not in self.txn_at:
                continue
            m0, m1 = self.mark_at[i]
            p0, f0, f1, commit = self.txn_at[i]
            rows.append(
                (
                    acked[i] - c,
                    {
                        "to_mark": max(0.0, m0 - c),
                        "mark": m1 - max(m0, min(c, m1)),
                        "queued": p0 - m1,
                        "begin_produce": f0 - p0,
                        "deliver": f1 - f0 - commit,
                        "commit": commit,
                    },
                )
            )
        if len(rows) < 100:
            return {}
        rows.sort(key=lambda r: r[0])
        slow = rows[len(rows) * 99 // 100 :]
        names = list(rows[0][1])
        return {
            "rows": len(rows),
            "median_ms": {k: round(statistics.median(r[1][k] for r in rows) * 1000, 2) for k in names},
            "slowest_1pct_mean_ms": {k: round(statistics.fmean(r[1][k] for r in slow) * 1000, 2) for k in names},
            "slowest_1pct_latency_ms": round(statistics.fmean(r[0] for r in slow) * 1000, 2),
        }
