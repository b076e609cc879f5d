"""Ack benchmark: `python -m bench.acks [--quick]`. The last line of output is one JSON object.

Against the local Postgres and Kafka (OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP, else the local services).
Each scenario pre-fills the ack topic, then starts ONE reaper (`reaper run`, acker only, a
subprocess) and times from its partition assignment until every bit of the batches is clear:

  single_id   one item id per Kafka message (the worst case for the acker)
  run_form    the same kind of acks sent through AckProducer, which compacts contiguous
              indexes into runs ('<b>:<g>:<start>-<end>') and packs one batch's acks per message
  packed_shuffled  AckProducer flushing every 10,000 acks of fully shuffled ids: few runs, but
              thousands of entries per message
  update_per_ack   baseline in the same run: one autocommit UPDATE per ack on a sample
  single_id_failed, run_form_failed   the same two shapes with failures instead of acks (entries
              written '!<id>' under a `failure-reason` header, 4 reasons in turn; AckProducer.fail
              for the run form): the failure path beside the ack path, as failures per second

Ack order: ids are shuffled within windows of 100,000, as consumers finishing work out of order.
The machine is shared (2 cores, Postgres and Kafka beside the benchmark): compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

import tracker
from tracker import schema as schema_mod
from tracker.consumer import AckProducer
from tracker.ids import GROUP_BITS_MAX

REPO = Path(__file__).resolve().parents[1]
DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:59092")
PARTITIONS = 4
TARGET = 500_000


def say(msg: str) -> None:
    print(f"[bench.acks] {msg}", file=sys.stderr, flush=True)


class Env:
    def __init__(self) -> None:
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        schema_mod.migrate(DSN, self.schema)
        self.admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
        self.topic = f"bench-acks-{uuid.uuid4().hex[:10]}"
        self.dlq = f"bench-dlq-{uuid.uuid4().hex[:10]}"
        fs = self.admin.create_topics(
            [
                NewTopic(self.topic, num_partitions=PARTITIONS, replication_factor=1),
                NewTopic(self.dlq, num_partitions=1, replication_factor=1),
            ]
        )
        for f in fs.values():
            f.result(30)

    def close(self) -> None:
        for f in self.admin.delete_topics([self.topic, self.dlq]).values():
            try:
                f.result(30)
            except Exception:
                pass
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')


def make_batches(env: Env, n: int, per_batch: int = 1_000_000) -> list[str]:
    """Closed batches holding n items; returns their ids in a consumer-like order."""
    ids: list[str] = []
    with psycopg.connect(DSN) as c:
        left = n
        while left:
            k = min(per_batch, left)
            b = tracker.open_batch(c, schema=env.schema)
            for h in tracker.add_items(c, b, k, schema=env.schema):
                ids.extend(h.item_ids)
            tracker.close_batch(c, b, schema=env.schema)
            left -= k
        c.commit()
    rnd = random.Random(7)
    for start in range(0, len(ids), 100_000):
        window = ids[start : start + 100_000]
        rnd.shuffle(window)
        ids[start : start + 100_000] = window
    return ids


def pending(env: Env, conn: psycopg.Connection | None = None) -> int:
    q = f'SELECT coalesce(sum(pending), 0) FROM "{env.schema}".batch'
    if conn is not None:
        return conn.execute(q).fetchone()[0]
    with psycopg.connect(DSN) as c:
        return c.execute(q).fetchone()[0]


REASONS = [f"bench failure {k}: upstream timed out" for k in range(4)]


def produce_single(env: Env, ids: list[str], *, failed: bool = False) -> int:
    p = Producer(
        {
            "bootstrap.servers": BOOTSTRAP,
            "linger.ms": 20,
            "batch.num.messages": 10000,
            "compression.type": "lz4",
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    headers = [[("failure-reason", r.encode())] for r in REASONS]
    for n, i in enumerate(ids):
        while True:
            try:
                if failed:  # one reason per 1,000 ids, in turn
                    p.produce(
                        env.topic,
                        key=i[: i.index(":")].encode(),
                        value=b"!" + i.encode(),
                        headers=headers[n // 1000 % 4],
                    )
                else:
                    p.produce(env.topic, key=i[: i.index(":")].encode(), value=i.encode())
                break
            except BufferError:
                p.poll(0.05)
    assert p.flush(120) == 0
    return len(ids)


def produce_runs(env: Env, ids: list[str], *, failed: bool = False) -> int:
    with AckProducer(bootstrap_servers=BOOTSTRAP, topic=env.topic, max_pending=100_000, linger=3600) as acks:
        for k in range(0, len(ids), 100_000):
            if failed:  # one reason per 100,000 ids, in turn
                acks.fail(ids[k : k + 100_000], REASONS[k // 100_000 % 4])
            else:
                acks.ack(ids[k : k + 100_000])
    return acks.messages_sent


def produce_single_failed(env: Env, ids: list[str]) -> int:
    return produce_single(env, ids, failed=True)


def produce_runs_failed(env: Env, ids: list[str]) -> int:
    return produce_runs(env, ids, failed=True)


def produce_packed_shuffled(env: Env, ids: list[str]) -> int:
    """AckProducer flushing every 10,000 acks over fully shuffled ids: short runs, many entries per message."""
    shuffled = list(ids)
    random.Random(11).shuffle(shuffled)
    with AckProducer(bootstrap_servers=BOOTSTRAP, topic=env.topic, max_pending=10_000, linger=3600) as acks:
        for k in range(0, len(shuffled), 10_000):
            acks.ack(shuffled[k : k + 10_000])
    return acks.messages_sent


def through_reaper(env: Env, expected: int, timeout: float = 900.0) -> dict:
    envvars = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    envvars.update(
        {
            "REAPER_DATABASE__DSN": DSN,
            "REAPER_DATABASE__SCHEMA": env.schema,
            "REAPER_KAFKA__BOOTSTRAP_SERVERS": BOOTSTRAP,
            "REAPER_HARVESTER__ENABLED": "false",
            "REAPER_SWEEPER__ENABLED": "false",
            "REAPER_METRICS__ENABLED": "false",
            "REAPER_ACKER__TOPIC": env.topic,
            "REAPER_ACKER__DEAD_LETTER_TOPIC": env.dlq,
            "REAPER_ACKER__GROUP": f"bench-{uuid.uuid4().hex[:8]}",
            "REAPER_LOGGING__FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "run"],
        cwd=REPO,
        env=envvars,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assigned = threading.Event()
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "ack partitions assigned" in line:
                assigned.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not assigned.wait(60):
            raise RuntimeError("the reaper's acker was never assigned its partitions:\n" + "".join(lines[-20:]))
        with psycopg.connect(DSN, autocommit=True) as watch:
            started = time.perf_counter()
            deadline = time.monotonic() + timeout
            while pending(env, watch) > 0:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("bits not cleared in time:\n" + "".join(lines[-20:]))
                time.sleep(0.02)
            seconds = time.perf_counter() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"acks": expected, "seconds": round(seconds, 3), "acks_per_s": round(expected / seconds)}


def update_per_ack(env: Env, ids: list[str], *, autocommit: bool = True) -> dict:
    """Baseline: one UPDATE per ack, each its own transaction (a consumer acking as it goes), or
    (autocommit=False) all in one transaction, which leaves out the commit per ack."""
    q = (
        f'UPDATE "{env.schema}".batch_group SET bits = set_bit(bits, %s, 0), pending = pending - get_bit(bits, %s) '
        f"WHERE batch_id = %s AND id = %s"
    )
    with psycopg.connect(DSN, autocommit=autocommit) as c:
        started = time.perf_counter()
        for i in ids:
            b, g, idx = (int(x) for x in i.split(":"))
            c.execute(q, [idx, idx, b, g], prepare=True)
        c.commit()
        seconds = time.perf_counter() - started
    return {"acks": len(ids), "seconds": round(seconds, 3), "acks_per_s": round(len(ids) / seconds)}


def scenario(name: str, n: int, produce) -> dict:
    env = Env()
    try:
        ids = make_batches(env, n)
        t0 = time.perf_counter()
        messages = produce(env, ids)
        produce_s = time.perf_counter() - t0
        say(f"{name}: {n:,} acks in {messages:,} messages produced in {produce_s:.1f}s; starting the reaper")
        result = through_reaper(env, n)
        result.update(messages=messages, produce_s=round(produce_s, 2))
        say(f"{name}: {result}")
        return result
    finally:
        env.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for development")
    args = ap.parse_args(argv)
    n_single = 200_000 if args.quick else 2_000_000
    n_runs = 1_000_000 if args.quick else 10_000_000
    n_sample = 1_000 if args.quick else 5_000
    single = scenario("single_id", n_single, produce_single)
    runs = scenario("run_form", n_runs, produce_runs)
    packed = scenario("packed_shuffled", n_single, produce_packed_shuffled)
    single_failed = scenario("single_id_failed", n_single, produce_single_failed)
    runs_failed = scenario("run_form_failed", n_runs, produce_runs_failed)
    for r in (single_failed, runs_failed):
        r["failures_per_s"] = r.pop("acks_per_s")
        r["failures"] = r.pop("acks")
    env = Env()
    try:
        sample = make_batches(env, 2 * GROUP_BITS_MAX)
        base = update_per_ack(env, sample[:n_sample])
        say(f"update_per_ack (commit each): {base}")
        one_txn = update_per_ack(env, sample[n_sample : n_sample * 5], autocommit=False)
        say(f"update_per_ack (one transaction): {one_txn}")
    finally:
        env.close()
    out = {
        "bench": "acks",
        "quick": args.quick,
        "partitions": PARTITIONS,
        "single_id": single,
        "run_form": runs,
        "packed_shuffled": packed,
        "single_id_failed": single_failed,
        "run_form_failed": runs_failed,
        "update_per_ack": base,
        "update_per_ack_one_txn": one_txn,
        "single_id_acks_per_s": single["acks_per_s"],
        "run_form_acks_per_s": runs["acks_per_s"],
        "packed_shuffled_acks_per_s": packed["acks_per_s"],
        "update_per_ack_acks_per_s": base["acks_per_s"],
        "single_id_failures_per_s": single_failed["failures_per_s"],
        "run_form_failures_per_s": runs_failed["failures_per_s"],
        # failures through the ack topic vs acks of the same shape (goal: >= 0.5, within 2x)
        "ratio_single_id_failures_vs_acks": round(single_failed["failures_per_s"] / single["acks_per_s"], 2),
        "ratio_run_form_failures_vs_acks": round(runs_failed["failures_per_s"] / runs["acks_per_s"], 2),
        "failures_within_2x_of_acks": min(
            single_failed["failures_per_s"] / single["acks_per_s"], runs_failed["failures_per_s"] / runs["acks_per_s"]
        )
        >= 0.5,
        "ratio_single_id_vs_update": round(single["acks_per_s"] / base["acks_per_s"], 1),
        "ratio_run_form_vs_update": round(runs["acks_per_s"] / base["acks_per_s"], 1),
        "ratio_single_id_vs_update_one_txn": round(single["acks_per_s"] / one_txn["acks_per_s"], 1),
        "target_acks_per_s": TARGET,
        "run_form_meets_target": runs["acks_per_s"] >= TARGET,
        "single_id_meets_target": single["acks_per_s"] >= TARGET,
        "note": "shared 2-core machine: Postgres, Kafka, the reaper and the producer on the same cores",
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
