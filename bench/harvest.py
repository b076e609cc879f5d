"""Harvester benchmark: `python -m bench.harvest [--quick]`. The last line of output is one JSON object.

Against the local Postgres and Kafka (OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP, else the local services):
  throughput   pre-filled outbox (500,000 rows, 200-byte values, 1,000 keys) to all acknowledged by
               Kafka and purged, beside a naive single-row relay measured in the same run on a sample
  hot_key      the same with every row on one key
  sustained    a writer process offers a steady load; last-window rate / first-window rate
  latency      commit -> Kafka acknowledgement p50/p99 at 2,000 records/s offered
               (bench/harvest_latency.py)
  failover     publication gap after SIGKILL and after SIGTERM of the leader (reaper subprocesses;
               bench/harvest_failover.py)
  units        1 unit on 1 reaper vs 2 lanes on 2 reapers, same run: rates, ratio, reaper CPU µs per record
               (bench/harvest_units.py)
  fenced       commit -> Kafka p50/p99 at 2,000 rec/s, unfenced and with transactions, and the Kafka
               floor (a bare idempotent producer, bare transactional ones), alternated in each
               round; p99 ratios round by round, and where a row's time goes per phase
               (bench/harvest_latency.py, bench/fenced_floor.py)
  recovery     publishing resumes how long after a restarted Kafka / Postgres answers again
               (private service instances; bench/harvest_recovery.py)

`--baseline REF --only throughput [--pairs N] [--rows R]` compares instead of measuring against
targets: REF's harvester (checked out once under .local/bench-baselines, bench/baseline.py) and the
working tree's each run in a process of their own on the same pre-filled outbox (a fresh schema,
migrated by that side's own code, and fresh topics per run), alternating new old, old new, ... for
N pairs (bench/pairs.py), and after each pair the floor (bench/floor.py): a bare COPY of the same
rows and a bare idempotent produce of them. Reports each pair's ratio new/old with the median, min
and max, and the harvester's throughput as a fraction of the sequential and the overlapped floor
(last line: `baseline`, `floor`; `throughput.reaper.records_per_s` is the working tree's median).
The machine is shared (2 cores, Postgres and Kafka beside the benchmark): compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from bench import baseline, floor
from bench.harvest_once import prefill as prefill_rows
from bench.pairs import summary
from harvester import config as config_mod
from harvester import logs
from harvester.run import tune_process
from harvester.units import Harvester
from tracker import schema as schema_mod

REPO = Path(__file__).resolve().parents[1]
DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:59092")
PARTITIONS = 8
VALUE = b"v" * 200


def say(msg: str) -> None:
    print(f"[bench.harvest] {msg}", file=sys.stderr, flush=True)


class Env:
    """A fresh schema and topics for one measurement; dropped afterwards."""

    def __init__(self, partitions: int = PARTITIONS) -> None:
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        schema_mod.migrate(DSN, self.schema)
        self.admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
        self.topic = f"bench-{uuid.uuid4().hex[:10]}"
        self.leader_topic = f"bench-leader-{uuid.uuid4().hex[:10]}"
        fs = self.admin.create_topics(
            [
                NewTopic(self.topic, num_partitions=partitions, replication_factor=1),
                NewTopic(self.leader_topic, num_partitions=1, replication_factor=1),
            ]
        )
        for f in fs.values():
            f.result(30)
        self.group = f"bench-{uuid.uuid4().hex[:10]}"

    def config(self, kafka_producer: dict | None = None, dsn: str = DSN, **harvester) -> config_mod.Config:
        h = {
            "leader_topic": self.leader_topic,
            "leader_group": self.group,
            "heartbeat_timeout": 2.0,
            "session_timeout": 6.0,
            **harvester,
        }
        return config_mod.load(
            None,
            environ={},
            overrides={
                "database": {"dsn": dsn, "schema": self.schema},
                "kafka": {"bootstrap_servers": BOOTSTRAP, "producer": kafka_producer or {}},
                "harvester": h,
                "metrics": {"enabled": False},
            },
        )

    def count(self) -> int:
        with psycopg.connect(DSN) as c:
            return c.execute(f'SELECT count(*) FROM "{self.schema}".outbox').fetchone()[0]

    def drop(self) -> None:
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')
        for f in self.admin.delete_topics([self.topic, self.leader_topic]).values():
            try:
                f.result(30)
            except Exception:
                pass


def prefill(env: Env, n: int, keys: int) -> None:
    prefill_rows(DSN, env.schema, env.topic, n, keys)


def harvest_all(env: Env, n: int, dsn: str = DSN, **harvester) -> dict:
    """Harvests the n rows prefilled in env, the harvester connecting to dsn."""
    h = Harvester(env.config(dsn=dsn, **harvester)).start()
    try:
        while not h.leading:
            time.sleep(0.01)
        started = time.perf_counter()
        while h.publisher.purged_rows < n:
            time.sleep(0.01)
            if time.perf_counter() - started > 900:
                raise RuntimeError(f"only {h.publisher.purged_rows} of {n} purged after 900 s")
        elapsed = time.perf_counter() - started
    finally:
        h.stop(10)
    return {"records": n, "seconds": round(elapsed, 3), "records_per_s": round(n / elapsed)}


def naive_relay(env: Env, sample: int) -> dict:
    """One row at a time: SELECT ... FOR UPDATE SKIP LOCKED, produce, flush, DELETE, COMMIT."""
    producer = Producer({"bootstrap.servers": BOOTSTRAP, "enable.idempotence": True, "linger.ms": 0})
    q = (
        f'SELECT id, topic, key, value, header_keys, header_values FROM "{env.schema}".outbox '
        "ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED"
    )
    d = f'DELETE FROM "{env.schema}".outbox WHERE id = %s'
    with psycopg.connect(DSN) as conn:
        started = time.perf_counter()
        for _ in range(sample):
            row = conn.execute(q).fetchone()
            producer.produce(row[1], key=row[2], value=row[3], headers=list(zip(row[4], row[5])))
            producer.flush(30)
            conn.execute(d, [row[0]])
            conn.commit()
        elapsed = time.perf_counter() - started
    return {"sample_records": sample, "seconds": round(elapsed, 3), "records_per_s": round(sample / elapsed)}


def bench_throughput(n: int, naive_sample: int, **harvester) -> dict:
    env = Env()
    try:
        say(f"throughput: pre-filling {n} rows")
        prefill(env, n, keys=1000)
        say("throughput: naive single-row relay on a sample")
        naive = naive_relay(env, naive_sample)
        left = n - naive_sample
        say(f"throughput: harvesting {left} rows")
        fast = harvest_all(env, left, **harvester)
        assert env.count() == 0
        return {
            "reaper": fast,
            "naive_relay": naive,
            "ratio_vs_naive": round(fast["records_per_s"] / naive["records_per_s"], 1),
        }
    finally:
        env.drop()


def bench_hot_key(n: int, **harvester) -> dict:
    env = Env()
    try:
        say(f"hot key: pre-filling {n} rows on one key")
        prefill(env, n, keys=1)
        return harvest_all(env, n, **harvester)
    finally:
        env.drop()


def _writer(schema: str, topic: str, rate: float, seconds: float, chunk: int, out) -> None:
    """A separate process: COPY `chunk` rows at a time to offer `rate` rows/s for `seconds`."""
    sent = 0
    with psycopg.connect(DSN) as conn:
        started = time.monotonic()
        while (now := time.monotonic()) - started < seconds:
            due = int((now - started) * rate)
            if sent >= due:
                time.sleep(min(0.01, (sent - due + 1) / rate))
                continue
            with conn.cursor().copy(f'COPY "{schema}".outbox (topic, key, value) FROM STDIN') as cp:
                for i in range(sent, sent + chunk):
                    cp.write_row((topic, b"key-%d" % (i % 1000), VALUE))
            conn.commit()
            sent += chunk
    out.put(sent)


def bench_sustained(seconds: float, window: float, rate: float, vacuum_interval: float = 2.0, **harvester) -> dict:
    env = Env()
    h = Harvester(env.config(**{"vacuum_interval": vacuum_interval, **harvester})).start()
    try:
        while not h.leading:
            time.sleep(0.01)
        q = mp.get_context("spawn").Queue()
        writer = mp.get_context("spawn").Process(target=_writer, args=(env.schema, env.topic, rate, seconds, 500, q))
        say(f"sustained: offering {rate:.0f} rows/s for {seconds:.0f} s")
        writer.start()
        started = time.monotonic()
        samples = []
        while writer.is_alive():
            samples.append((time.monotonic() - started, h.publisher.purged_rows))
            time.sleep(1)
        offered = q.get(timeout=30)
        writer.join()
        samples.append((time.monotonic() - started, h.publisher.purged_rows))

        def rate_between(t0: float, t1: float) -> float:
            a = min(samples, key=lambda s: abs(s[0] - t0))
            b = min(samples, key=lambda s: abs(s[0] - t1))
            return (b[1] - a[1]) / max(1e-9, b[0] - a[0])

        end = samples[-1][0]
        first, last = rate_between(0, window), rate_between(end - window, end)
        backlog = env.count()
        return {
            "seconds": round(end, 1),
            "window_s": window,
            "offered_per_s": rate,
            "offered_rows": offered,
            "first_window_per_s": round(first),
            "last_window_per_s": round(last),
            "ratio_last_first": round(last / first, 3) if first else None,
            "backlog_at_end": backlog,
            "vacuum_interval_s": vacuum_interval,
            "vacuums": h.vacuums,
        }
    finally:
        h.stop(10)
        env.drop()


# CPU per record, compared pair by pair beside the rate (below 1 the working tree is cheaper; steadier
# than the rate when the machine is busy): the reaper's (every thread of the harvesting process), the
# database server's (marks, purges, WAL, vacuum) and the whole machine's (the budget all share).
CPU = ("cpu_us_per_record", "postgres_cpu_us_per_record", "machine_cpu_us_per_record")


def bench_baseline(ref: str, pairs: int, rows: int, overrides: dict, python: str, with_floor: bool) -> dict:
    """REF's harvester against the working tree's, alternating, plus the floor after each pair."""
    sets = [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]
    args = ["--dsn", DSN, "--bootstrap", BOOTSTRAP, "--rows", str(rows), *sets]
    floors: list[dict] = []

    def after_pair(i: int) -> dict | None:
        if not with_floor:
            return None
        f = floor.measure(DSN, BOOTSTRAP, rows)
        floors.append(f)
        say(f"floor after pair {i + 1}: {json.dumps(f)}")
        return f

    say(f"{pairs} pairs of {rows} rows")
    script = REPO / "bench" / "harvest_once.py"
    cmp = baseline.compare(
        ref, script, args, "records_per_s", pairs, log=say, python=python, after_pair=after_pair, more=CPU
    )
    out: dict = {
        "throughput": {"reaper": {"records": rows, "records_per_s": round(cmp["new"]["median"])}},
        "baseline": {**cmp, "rows": rows},
    }
    if floors:
        fraction = {
            f"{side}_of_{kind}": summary([p[side] / f[f"{kind}_per_s"] for p, f in zip(cmp["pairs"], floors)])
            for side in ("new", "old")
            for kind in ("sequential", "overlapped")
        }
        out["floor"] = {
            "records": rows,
            "sequential_per_s": summary([f["sequential_per_s"] for f in floors]),
            "overlapped_per_s": summary([f["overlapped_per_s"] for f in floors]),
            "copy_per_s": summary([f["copy_per_s"] for f in floors]),
            "produce_per_s": summary([f["produce_per_s"] for f in floors]),
            "fraction": fraction,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes and short windows (development)")
    ap.add_argument(
        "--only",
        choices=["throughput", "hot_key", "sustained", "latency", "failover", "recovery", "units", "fenced"],
        action="append",
    )
    ap.add_argument("--sustained-rate", type=float, default=20000.0, help="rows/s the writer offers")
    ap.add_argument("--sustained-seconds", type=float, help="override the sustained run's length")
    ap.add_argument("--fenced-seconds", type=float, help="fenced: seconds per measurement (default 30; 8 with --quick)")
    ap.add_argument("--fenced-rounds", type=int, help="fenced: rounds (default 2; 1 with --quick)")
    ap.add_argument(
        "--fenced-partitions",
        type=int,
        default=PARTITIONS,
        help=f"fenced: partitions of the topic (default {PARTITIONS}); a transaction writes to those of its records' keys",
    )
    ap.add_argument(
        "--vacuum-interval",
        type=float,
        default=2.0,
        help="harvester.vacuum_interval for the sustained run (0 = autovacuum only)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a harvester.KEY for the in-process reaper of throughput, hot_key, sustained, latency and fenced "
        "(e.g. --set mark_batch=10000), and with --baseline for both sides' reapers; repeatable",
    )
    ap.add_argument("--baseline", metavar="REF", help="compare throughput with commit REF's harvester, same run")
    ap.add_argument("--pairs", type=int, default=5, help="with --baseline: pairs of runs (default 5)")
    ap.add_argument("--rows", type=int, help="with --baseline: rows per run (default 200,000; 50,000 with --quick)")
    ap.add_argument(
        "--baseline-python",
        metavar="PATH",
        help="with --baseline: the interpreter for REF (default this one; give one whose packages "
        "satisfy REF's dependencies if this one's do not)",
    )
    ap.add_argument("--no-floor", action="store_true", help="with --baseline: skip the floor measurements")
    args = ap.parse_args(argv)
    if args.baseline is not None and set(args.only or ["throughput"]) != {"throughput"}:
        ap.error("--baseline compares throughput only: use it with --only throughput")
    if args.pairs < 1:
        ap.error("--pairs must be at least 1")
    if args.rows is not None and args.rows < 1:
        ap.error("--rows must be at least 1")
    if args.fenced_rounds is not None and args.fenced_rounds < 1:
        ap.error("--fenced-rounds must be at least 1")
    if not 1 <= args.fenced_partitions <= 1000:
        ap.error(f"--fenced-partitions must be between 1 and 1000, got {args.fenced_partitions}")
    if args.fenced_seconds is not None and args.fenced_seconds <= 0:
        ap.error("--fenced-seconds must be positive")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = value.strip()  # coerced and validated by the configuration loader
    logs.configure("json", "warning")
    tune_process()  # the in-process reapers run with the process settings of `reaper run`
    q = args.quick
    want = set(
        args.only or ["throughput", "hot_key", "sustained", "latency", "failover", "recovery", "units", "fenced"]
    )
    result: dict = {
        "benchmark": "harvest",
        "quick": q,
        "harvester_overrides": overrides,
        "machine": "shared 2-core host, Postgres and Kafka local",
        "targets": {
            "records_per_s": 50000,
            "hot_key_records_per_s": 5000,
            "sustained_ratio": 0.8,
            "latency_p99_ms": 50,
            "sigterm_handover_s": 2.0,
            "sigkill_failover_s": "session_timeout + 2",
            "recovery_gap_s": {"postgres": 1.0, "kafka": 3.0},
        },
    }
    if args.baseline is not None:
        rows = args.rows or (50_000 if q else 200_000)
        result.update(
            bench_baseline(
                args.baseline, args.pairs, rows, overrides, args.baseline_python or sys.executable, not args.no_floor
            )
        )
        say(json.dumps({k: result[k] for k in ("baseline", "floor") if k in result}))
    elif "throughput" in want:
        result["throughput"] = bench_throughput(100_000 if q else 500_000, 300 if q else 1000, **overrides)
        say(json.dumps(result["throughput"]))
    if "hot_key" in want:
        result["hot_key"] = bench_hot_key(30_000 if q else 100_000, **overrides)
        say(json.dumps(result["hot_key"]))
    if "latency" in want:
        from bench.harvest_latency import bench_latency

        result["latency"] = bench_latency(8 if q else 30, 2000.0, **overrides)
        say(json.dumps(result["latency"]))
    if "failover" in want:
        from bench.harvest_failover import bench_failover

        result["failover_sigterm"] = bench_failover(signal.SIGTERM, 6.0, 2.0)
        say(json.dumps(result["failover_sigterm"]))
        result["failover_sigkill"] = bench_failover(signal.SIGKILL, 6.0, 2.0)
        say(json.dumps(result["failover_sigkill"]))
    if "units" in want:
        from bench.harvest_units import bench_lane_index, bench_units

        result["units"] = bench_units(DSN, BOOTSTRAP, 100_000 if q else 300_000, rounds=1 if q else 2)
        result["units"]["lane_index"] = bench_lane_index(DSN, rows=50_000 if q else 200_000)
        say(json.dumps(result["units"]))
    if "fenced" in want:
        from bench.harvest_latency import bench_fenced

        result["fenced"] = bench_fenced(
            args.fenced_seconds or (8 if q else 30),
            2000.0,
            rounds=args.fenced_rounds or (1 if q else 2),
            partitions=args.fenced_partitions,
            **overrides,
        )
        say(json.dumps(result["fenced"]))
    if "recovery" in want:
        from bench.harvest_recovery import bench_recovery

        result["recovery"] = bench_recovery(DSN, BOOTSTRAP)
        say(json.dumps(result["recovery"]))
    if "sustained" in want:
        result["sustained"] = bench_sustained(
            args.sustained_seconds or (60 if q else 630),
            15 if q else 60,
            args.sustained_rate,
            args.vacuum_interval,
            **overrides,
        )
        say(json.dumps(result["sustained"]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
