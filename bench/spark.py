"""Spark benchmark: `python -m bench.spark [--quick]`. The last line of output is one JSON object.

On Spark local[2] against the local Postgres and Kafka (OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP, else
the local services), in one run:

  fan_out          tracker.spark.fan_out of a DataFrame of N rows (10,000,000; --quick 1,000,000)
                   into the outbox, groups and batch totals, until the batch is closed (items/s)
  enqueue_baseline tracker.outbox.enqueue of a sample in one process and one transaction (items/s)
  stream_ack       ack_stream over the ack topic pre-filled with one item id per message for every
                   row of the fan-out, from the query's start until every bit is clear (acks/s)
  dataframe_ack    ack_dataframe of a DataFrame of N item ids of another batch (acks/s)
  direct_baseline  tracker.ack of a sample in one call, one process (acks/s)

The machine is shared (2 cores: Spark, Postgres, Kafka and the benchmark); compare ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

import tracker
from tracker import outbox
from tracker import schema as schema_mod
from tracker import spark as tspark

REPO = Path(__file__).resolve().parents[1]
DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:59092")
FAN_OUT_TARGET = 200_000


def say(msg: str) -> None:
    print(f"[bench.spark] {msg}", file=sys.stderr, flush=True)


def connector_jars() -> str:
    r = subprocess.run([sys.executable, str(REPO / "deploy" / "spark" / "jars.py")], capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"could not resolve the Spark Kafka connector:\n{r.stderr[-3000:]}")
    return r.stdout.strip().split("=", 1)[1]


def pending(conn: psycopg.Connection, schema: str, batch_id: int) -> int:
    return conn.execute(f'SELECT pending FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()[0]


def groups_of(conn: psycopg.Connection, schema: str, batch_id: int) -> list[tuple[int, int]]:
    return conn.execute(f'SELECT id, size FROM "{schema}".batch_group WHERE batch_id = %s ORDER BY id',
                        [batch_id]).fetchall()


def produce_ids(topic: str, batch_id: int, groups: list[tuple[int, int]]) -> int:
    p = Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 20, "batch.num.messages": 10000,
                  "compression.type": "lz4", "queue.buffering.max.messages": 1_000_000})
    key = str(batch_id).encode()
    n = 0
    for g, size in groups:
        prefix = f"{batch_id}:{g}:"
        for i in range(size):
            while True:
                try:
                    p.produce(topic, key=key, value=(prefix + str(i)).encode())
                    break
                except BufferError:
                    p.poll(0.05)
        n += size
    assert p.flush(300) == 0
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000,000 rows instead of 10,000,000")
    ap.add_argument("--rows", type=int, help="rows to fan out and ids to ack (overrides --quick)")
    args = ap.parse_args(argv)
    n = args.rows or (1_000_000 if args.quick else 10_000_000)
    partitions = max(4, n // 500_000)
    sample = 200_000 if n >= 1_000_000 else max(1, n // 5)

    jars = connector_jars()
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    schema_mod.migrate(DSN, schema)
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    topic = f"bench-acks-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])[topic].result(30)
    checkpoints = tempfile.mkdtemp(prefix="bench-spark-")
    spark = tspark.local_session("local[2]", jars=jars, app_name="bench-spark", conf={
        "spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "4", "spark.driver.memory": "2g",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "20000"})
    out: dict = {"bench": "spark", "quick": args.quick, "rows": n, "master": "local[2]", "partitions": partitions}
    try:
        # -- warm-up (JVM, Python workers and their imports), not timed
        tspark.fan_out(spark.range(0, 20_000, numPartitions=4).selectExpr("CAST(id AS STRING) AS value"),
                       dsn=DSN, topic="bench-warm-up", schema=schema)

        # -- fan-out
        df = spark.range(0, n, numPartitions=partitions).selectExpr("CAST(concat('item-', id) AS BINARY) AS value")
        started = time.perf_counter()
        result = tspark.fan_out(df, dsn=DSN, topic="bench-work", schema=schema, user_key="bench")
        seconds = time.perf_counter() - started
        assert result.items == n, result
        out["fan_out"] = {"items": n, "groups": result.groups, "seconds": round(seconds, 2),
                          "items_per_s": round(n / seconds)}
        say(f"fan_out: {out['fan_out']}")

        # -- baseline: enqueue in one process
        with psycopg.connect(DSN) as c:
            b = tracker.open_batch(c, schema=schema)
            values = [b"item-%d" % i for i in range(sample)]
            started = time.perf_counter()
            outbox.enqueue(c, b, values, topic="bench-work", schema=schema)
            c.commit()
            seconds = time.perf_counter() - started
        out["enqueue_baseline"] = {"items": sample, "seconds": round(seconds, 2), "items_per_s": round(sample / seconds)}
        say(f"enqueue_baseline: {out['enqueue_baseline']}")

        # -- streaming ack of every fan-out row, one id per Kafka message
        with psycopg.connect(DSN, autocommit=True) as watch:
            groups = groups_of(watch, schema, result.batch_id)
            started = time.perf_counter()
            produced = produce_ids(topic, result.batch_id, groups)
            say(f"stream_ack: {produced:,} ids produced to Kafka in {time.perf_counter() - started:.1f}s")
            started = time.perf_counter()
            query, totals = tspark.ack_stream(
                spark, bootstrap_servers=BOOTSTRAP, topic=topic, dsn=DSN, schema=schema,
                checkpoint_location=os.path.join(checkpoints, "stream"), max_offsets_per_trigger=2_000_000)
            try:
                while pending(watch, schema, result.batch_id) > 0:
                    if query.exception() is not None:
                        raise RuntimeError(f"stream failed: {query.exception()}")
                    time.sleep(0.1)
                seconds = time.perf_counter() - started
                while not totals.completed:  # let the micro-batch finish before stopping the query
                    time.sleep(0.1)
            finally:
                query.stop()
        out["stream_ack"] = {"acks": produced, "micro_batches": totals.batches, "seconds": round(seconds, 2),
                             "acks_per_s": round(produced / seconds), "completed": totals.completed == [result.batch_id]}
        say(f"stream_ack: {out['stream_ack']}")

        # -- DataFrame bulk ack of another batch's ids
        with psycopg.connect(DSN) as c:
            other = tracker.open_batch(c, schema=schema)
            tracker.add_items(c, other, n, schema=schema)
            tracker.close_batch(c, other, schema=schema)
            c.commit()
            groups = groups_of(c, schema, other.id)
        gdf = spark.createDataFrame(groups, "g long, size int").repartition(partitions)
        ids = gdf.selectExpr("explode(sequence(0, size - 1)) AS i", "g").selectExpr(
            f"concat('{other.id}:', g, ':', i) AS item_id")
        started = time.perf_counter()
        acked = tspark.ack_dataframe(ids, dsn=DSN, schema=schema)
        seconds = time.perf_counter() - started
        assert acked.acked == n and acked.completed == [other.id], (acked.acked, acked.completed)
        out["dataframe_ack"] = {"acks": n, "seconds": round(seconds, 2), "acks_per_s": round(n / seconds)}
        say(f"dataframe_ack: {out['dataframe_ack']}")

        # -- baseline: the direct path, one call in one process
        with psycopg.connect(DSN) as c:
            b = tracker.open_batch(c, schema=schema)
            handles = tracker.add_items(c, b, sample, schema=schema)
            c.commit()
            sample_ids = [i for h in handles for i in h.item_ids]
            started = time.perf_counter()
            tracker.ack(c, sample_ids, schema=schema)
            c.commit()
            seconds = time.perf_counter() - started
        out["direct_baseline"] = {"acks": sample, "seconds": round(seconds, 2), "acks_per_s": round(sample / seconds)}
        say(f"direct_baseline: {out['direct_baseline']}")
    finally:
        spark.stop()
        shutil.rmtree(checkpoints, ignore_errors=True)
        try:
            admin.delete_topics([topic])[topic].result(30)
        except Exception:
            pass
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    out.update({
        "fan_out_items_per_s": out["fan_out"]["items_per_s"],
        "stream_ack_acks_per_s": out["stream_ack"]["acks_per_s"],
        "dataframe_ack_acks_per_s": out["dataframe_ack"]["acks_per_s"],
        "ratio_fan_out_vs_enqueue": round(out["fan_out"]["items_per_s"] / out["enqueue_baseline"]["items_per_s"], 2),
        "ratio_stream_ack_vs_direct": round(out["stream_ack"]["acks_per_s"] / out["direct_baseline"]["acks_per_s"], 2),
        "fan_out_target_items_per_s": FAN_OUT_TARGET,
        "fan_out_meets_target": out["fan_out"]["items_per_s"] >= FAN_OUT_TARGET,
        "note": "shared 2-core machine: Spark local[2], Postgres and Kafka on the same cores",
    })
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
