"""Commit -> Kafka latency of the harvester at a steady offered rate, and fenced vs unfenced
publishing (`python -m bench.harvest --only latency` / `--only fenced`; run from bench/harvest.py).

An in-process Harvester; each row's latency is from its insert's commit to its acknowledgement
(straight from the delivery report, or, with harvester.transactional_id, when its transaction
commits), measured in steady state after one row has gone through.
"""

from __future__ import annotations

import collections
import statistics
import time
import uuid

import psycopg
from prometheus_client import CollectorRegistry

from bench.fenced_floor import Phases, bare
from bench.harvest import BOOTSTRAP, DSN, PARTITIONS, VALUE, Env
from harvester.metrics import HarvesterMetrics
from harvester.units import Harvester


def recording_commits() -> tuple[HarvesterMetrics, list[float]]:
    """The harvester's collectors on a private registry, its transaction-commit histogram also
    keeping every duration it observes (in the list returned)."""
    metrics, seen = HarvesterMetrics("bench", registry=CollectorRegistry()), []
    histogram = metrics.txn_duration

    class Recording:
        def observe(self, amount: float) -> None:
            seen.append(amount)
            histogram.observe(amount)

    metrics.txn_duration = Recording()  # type: ignore[assignment]
    return metrics, seen


def stamping(reports, acked: dict[int, float]):
    """The publisher's settle queue `reports`, stamping each acknowledged row (no error) in `acked`
    as it enters: straight from its delivery report, or (harvester.transactional_id) when its
    transaction commits."""
    base = type(reports)

    class Stamped(base):  # type: ignore[misc, valid-type]
        def append(self, item):
            if item[2] is None:
                acked.setdefault(item[0], time.time())
            super().append(item)

        def extend(self, items):
            items, now = list(items), time.time()
            for item in items:
                if item[2] is None:
                    acked.setdefault(item[0], now)
            super().extend(items)

    return Stamped(reports)


def bench_latency(
    seconds: float, rate: float, kafka_producer: dict | None = None, partitions: int = PARTITIONS, **harvester
) -> dict:
    env = Env(partitions)
    # Commit durations, as the harvester observes them in its transaction-commit histogram.
    metrics, commit_seconds = recording_commits()
    h = Harvester(env.config(kafka_producer, **harvester), metrics=metrics).start()
    acked: dict[int, float] = {}
    try:
        while not h.leading:
            time.sleep(0.01)

        h.publisher.settler.reports = stamping(collections.deque(), acked)  # nothing produced yet
        phases = Phases(h.unit, commit_seconds)
        committed: dict[int, float] = {}
        per_txn = 10
        ins = (
            f'INSERT INTO "{env.schema}".outbox (topic, key, value) '
            "SELECT %s, convert_to('key-' || ((g + %s) %% 1000), 'UTF8'), %s FROM generate_series(1, %s) g "
            "RETURNING id"
        )  # keys go round 1,000 from one insert to the next, as the floor's do (bench/fenced_floor.py)
        with psycopg.connect(DSN) as conn:
            # Steady state: one row through first, so the leadership's start (fenced mode: the
            # producers' init_transactions, sometimes 0.5 s) is not in the figures.
            conn.execute(ins, [env.topic, -1, VALUE, 1])
            conn.commit()
            warm_until = time.monotonic() + 30
            while not acked and time.monotonic() < warm_until:
                time.sleep(0.005)
            acked.clear()
            started, started_wall = time.monotonic(), time.time()
            sent = 0
            while time.monotonic() - started < seconds:
                due = (time.monotonic() - started) * rate
                if sent >= due:
                    time.sleep(0.0005)
                    continue
                ids = [r[0] for r in conn.execute(ins, [env.topic, sent, VALUE, per_txn]).fetchall()]
                conn.commit()
                t = time.time()
                for i in ids:
                    committed[i] = t
                sent += per_txn
        deadline = time.monotonic() + 30
        while len(acked) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.05)
        lat = sorted(acked[i] - committed[i] for i in committed if i in acked)
        q = statistics.quantiles(lat, n=100)
        out = {
            "offered_per_s": rate,
            "records": len(committed),
            "acknowledged": len(lat),
            "p50_ms": round(q[49] * 1000, 2),
            "p99_ms": round(q[98] * 1000, 2),
            "max_ms": round(lat[-1] * 1000, 2),
            # when the slowest rows were committed (s after the first): a start-up stall or not
            "over_100ms_at_s": sorted(
                {
                    round(committed[i] - started_wall, 1)
                    for i in committed
                    if i in acked and acked[i] - committed[i] > 0.1
                }
            )[:20],
        }
        out["breakdown"] = phases.breakdown(committed, acked)
        strategy = h.publisher.strategy
        if h.publisher.transactional and len(commit_seconds) >= 2:
            c = statistics.quantiles(commit_seconds, n=100)
            out.update(
                {
                    "transactions": strategy.committed,
                    "aborted": strategy.aborted,
                    "records_per_transaction": round(strategy.records_committed / max(1, strategy.committed), 1),
                    "commit_p50_ms": round(c[49] * 1000, 2),
                    "commit_p99_ms": round(c[98] * 1000, 2),
                }
            )
        return out
    finally:
        h.stop(10)
        env.drop()


def bench_fenced(seconds: float, rate: float, rounds: int = 2, partitions: int = PARTITIONS, **harvester) -> dict:
    """Unfenced and transactional latency, and the machine's Kafka floor (bench/fenced_floor.py: a
    bare idempotent producer, a bare transactional one, two in turn), alternated in each round, on
    a topic of `partitions` partitions. Ratios are taken round by round (same minutes of the same
    run), then summarised."""
    plain, fenced, floor_idem, floor_txn, floor_txn2 = [], [], [], [], []
    for _ in range(rounds):
        env = Env(partitions)
        try:
            floor_idem.append(bare(BOOTSTRAP, env.topic, seconds, rate))
            floor_txn.append(bare(BOOTSTRAP, env.topic, seconds, rate, producers=1))
            floor_txn2.append(bare(BOOTSTRAP, env.topic, seconds, rate, producers=2))
        finally:
            env.drop()
        plain.append(bench_latency(seconds, rate, partitions=partitions, **harvester))
        fenced.append(
            bench_latency(
                seconds,
                rate,
                partitions=partitions,
                **{**harvester, "transactional_id": f"bench-{uuid.uuid4().hex[:8]}"},
            )
        )

    def ratios(a: list[dict], b: list[dict]) -> list[float]:
        return [round(x["p99_ms"] / y["p99_ms"], 2) for x, y in zip(a, b)]

    fenced_p99 = max(r["p99_ms"] for r in fenced)
    return {
        "partitions": partitions,
        "unfenced": plain,
        "fenced": fenced,
        "floor": {"idempotent": floor_idem, "transactional": floor_txn, "transactional_two_in_turn": floor_txn2},
        "p99_ratio": {
            "fenced_over_unfenced": ratios(fenced, plain),
            "fenced_over_bare_transactional": ratios(fenced, floor_txn2),
            "bare_transactional_over_bare_idempotent": ratios(floor_txn2, floor_idem),
            "unfenced_over_bare_idempotent": ratios(plain, floor_idem),
        },
        "p99_excess_ms": {
            "fenced_minus_unfenced": [round(x["p99_ms"] - y["p99_ms"], 2) for x, y in zip(fenced, plain)],
            "fenced_minus_bare_transactional": [
                round(x["p99_ms"] - y["p99_ms"], 2) for x, y in zip(fenced, floor_txn2)
            ],
        },
        "goal_fenced_p99_ms": 25,
        "fenced_p99_ms": fenced_p99,
        "unfenced_p99_ms": max(r["p99_ms"] for r in plain),
        "fenced_meets_goal": fenced_p99 <= 25,
    }
