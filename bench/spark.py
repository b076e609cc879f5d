"""Spark benchmark: `python -m bench.spark [--quick] [--masters cluster,local[2]]`. Last line: one JSON object.

Against the local Postgres and Kafka (OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP, else the local services)
and, for `cluster`, the local Spark standalone cluster (master + 2 workers, started idempotently;
executors run the node Python and import the shipped tracker zip). The same work runs on every
master in one run, so the ratios compare them:

  fan_out          tracker.spark.fan_out of N rows read from Parquet (10,000,000; --quick 1,000,000)
                   into the outbox, groups and batch totals, until the batch is closed (items/s)
  stream_ack       ack_stream over an ack topic holding one item id per message for every row of
                   the fan-out (written to Kafka by Spark), from start() until every bit is clear
                   (acks/s); `steady_acks_per_s` leaves out the query's start: rows / busy time of
                   its micro-batches, from the StreamingQueryListener
  stream_ack_packed  the same for the N ids of another batch sent as lists of 4,000 shuffled ids
                   per message (tracker.consumer.AckProducer's format for out-of-order acks)
  dataframe_ack    ack_dataframe of N item ids of another batch (acks/s)
  peak RSS         sampled every 0.2 s: the driver (this Python + its JVM) and each executor (JVM
                   + its Python workers; on local[N] the executors live in the driver JVM)
  baselines        tracker.outbox.enqueue and tracker.ack of a sample, one process (once per run)

The machine is shared (2 cores: Spark, Postgres, Kafka and the benchmark); compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic

import tracker
from tracker import outbox
from tracker import schema as schema_mod
from tracker import spark as tspark

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from support.spark import connector_jars, descendants, executor_pids, master_and_python  # noqa: E402

DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:59092")
FAN_OUT_TARGET, STREAM_TARGET, STREAM_RATIO_TARGET = 200_000, 200_000, 0.5


def say(msg: str) -> None:
    print(f"[bench.spark] {msg}", file=sys.stderr, flush=True)


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class PeakRss(threading.Thread):
    """Peak resident memory of the driver and of each executor, sampled every 0.2 s, per phase."""

    def __init__(self, app_id: str) -> None:
        super().__init__(daemon=True)
        self.app_id, self.phase, self.peaks, self.done = app_id, "setup", {}, threading.Event()

    def sample(self) -> None:
        me = os.getpid()
        jvms = (
            [p for p in descendants(me) if "java" in Path(f"/proc/{p}/comm").read_text(errors="replace")]
            if Path(f"/proc/{me}").exists()
            else []
        )
        values = {"driver_python": rss_mib(me), "driver_jvm": sum(rss_mib(p) for p in jvms)}
        execs = executor_pids(self.app_id)
        if execs:
            for k, pid in enumerate(execs):
                values[f"executor_{k}"] = rss_mib(pid) + sum(rss_mib(c) for c in descendants(pid))
        else:  # local[N]: the executor is the driver JVM; its Python workers are its children
            values["local_python_workers"] = sum(rss_mib(c) for j in jvms for c in descendants(j))
        peaks = self.peaks.setdefault(self.phase, {})
        for k, v in values.items():
            peaks[k] = max(peaks.get(k, 0.0), round(v, 1))

    def run(self) -> None:
        while not self.done.wait(0.2):
            try:
                self.sample()
            except OSError:
                pass


def pending(conn: psycopg.Connection, schema: str, batch_id: int) -> int:
    return conn.execute(f'SELECT pending FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()[0]


def ids_df(spark, conn: psycopg.Connection, schema: str, batch_id: int, partitions: int):
    """One item id per row for every item of the batch, generated on the executors."""
    groups = conn.execute(
        f'SELECT id, size FROM "{schema}".batch_group WHERE batch_id = %s ORDER BY id', [batch_id]
    ).fetchall()
    gdf = spark.createDataFrame(groups, "g long, size int").repartition(partitions)
    return gdf.selectExpr("explode(sequence(0, size - 1)) AS i", "g").selectExpr(
        f"concat('{batch_id}:', g, ':', i) AS item_id"
    )


# Lists of shuffled ids, AckProducer's message format for acks of consumers that finish out of
# order (it also compacts contiguous indexes into runs, which would make it cheaper still): about
# 4,000 ids of ~13 bytes a message, below its 64 KiB max_message_bytes.
PACKED_PER_MESSAGE = 4_000
STREAM_TIMEOUT = 1800.0  # seconds: a stream that stops without an exception must not hang the run


def stream_scenario(
    spark,
    label: str,
    n: int,
    batch_id: int,
    topic: str,
    schema: str,
    partitions: int,
    checkpoints: str,
    packed: int = 0,
) -> dict:
    """Write every item id of `batch_id` to `topic` (one per message, or `packed` shuffled ids per
    message), then time ack_stream from start() until every bit is clear."""
    from confluent_kafka import Consumer, TopicPartition
    from pyspark.sql import functions as F

    with psycopg.connect(DSN, autocommit=True) as watch:
        started = time.perf_counter()
        ids = ids_df(spark, watch, schema, batch_id, partitions)
        if packed:
            buckets = max(1, n // packed)
            ids = (
                ids.selectExpr("item_id", f"CAST(rand(7) * {buckets} AS INT) AS bucket")
                .groupBy("bucket")
                .agg(F.concat_ws(",", F.shuffle(F.collect_list("item_id"))).alias("item_id"))
            )
        (
            ids.selectExpr(f"'{batch_id}' AS key", "item_id AS value")
            .write.format("kafka")
            .option("kafka.bootstrap.servers", BOOTSTRAP)
            .option("topic", topic)
            .option("kafka.linger.ms", "20")
            .option("kafka.compression.type", "lz4")
            .option("kafka.max.request.size", str(8 << 20))
            .save()
        )
        form = f"{packed:,} shuffled ids per message" if packed else "one id per message"
        say(f"{label}: {n:,} ids written to Kafka by Spark ({form}) in {time.perf_counter() - started:.1f}s")
        offsets = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"bench-{topic}"})
        try:
            parts = offsets.list_topics(topic, timeout=30).topics[topic].partitions
            messages = sum(offsets.get_watermark_offsets(TopicPartition(topic, k), timeout=30)[1] for k in parts)
        finally:
            offsets.close()
        started = time.perf_counter()
        query, totals = tspark.ack_stream(
            spark,
            bootstrap_servers=BOOTSTRAP,
            topic=topic,
            dsn=DSN,
            schema=schema,
            checkpoint_location=os.path.join(checkpoints, f"{label}-{topic}"),
            query_name=f"bench-{label}-{topic}",
        )

        def running() -> None:
            if query.exception() is not None:
                raise RuntimeError(f"stream failed: {query.exception()}")
            if not query.isActive or time.perf_counter() - started > STREAM_TIMEOUT:
                raise RuntimeError(f"stream stopped or took over {STREAM_TIMEOUT:.0f} s")

        try:
            while pending(watch, schema, batch_id) > 0:
                running()
                time.sleep(0.05)
            seconds = time.perf_counter() - started
            while totals.progress.input_rows < messages:  # the last micro-batch's progress event
                running()
                time.sleep(0.05)
        finally:
            query.stop()
    p = totals.progress
    return {
        "acks": n,
        "form": form,
        "messages": messages,
        "micro_batches": p.batches,
        "seconds": round(seconds, 2),
        "acks_per_s": round(n / seconds),
        "steady_acks_per_s": round(n / p.busy_seconds) if p.busy_seconds else None,
        "max_offsets_per_trigger": tspark.stream.DEFAULT_MAX_OFFSETS_PER_TRIGGER,
        "completed": totals.completed_count == 1,
    }


def run_master(
    label: str,
    master: str,
    python: str,
    *,
    n: int,
    parquet: str,
    partitions: int,
    schema: str,
    jars: str,
    admin: AdminClient,
    checkpoints: str,
) -> dict:
    conf = {
        "spark.sql.shuffle.partitions": str(partitions),
        "spark.default.parallelism": "4",
        "spark.sql.execution.arrow.maxRecordsPerBatch": "20000",
        "spark.driver.memory": "1g",
    }
    spark = tspark.session(master, python=python, jars=jars, app_name=f"bench-spark-{label}", conf=conf)
    sampler = PeakRss(spark.sparkContext.applicationId)
    sampler.start()
    out: dict = {"master": master}
    topic = f"bench-acks-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(topic, num_partitions=4, replication_factor=1)])[topic].result(30)
    topics = [topic]
    try:
        # warm-up (executors, Python workers and their imports), not timed
        tspark.fan_out(
            spark.range(0, 20_000, numPartitions=4).selectExpr("CAST(id AS STRING) AS value"),
            dsn=DSN,
            topic="bench-warm-up",
            schema=schema,
        )

        sampler.phase = "fan_out"
        df = spark.read.parquet(parquet)
        started = time.perf_counter()
        result = tspark.fan_out(df, dsn=DSN, topic="bench-work", schema=schema, user_key=f"bench-{label}")
        seconds = time.perf_counter() - started
        assert result.items == n, result
        out["fan_out"] = {
            "items": n,
            "groups": result.groups,
            "partitions": df.rdd.getNumPartitions(),
            "seconds": round(seconds, 2),
            "items_per_s": round(n / seconds),
        }
        say(f"{label} fan_out: {out['fan_out']}")

        sampler.phase = "stream_ack"
        out["stream_ack"] = stream_scenario(spark, label, n, result.batch_id, topic, schema, partitions, checkpoints)
        say(f"{label} stream_ack: {out['stream_ack']}")

        sampler.phase = "stream_ack_packed"
        packed_topic = f"bench-acks-packed-{uuid.uuid4().hex[:10]}"
        admin.create_topics([NewTopic(packed_topic, num_partitions=4, replication_factor=1)])[packed_topic].result(30)
        topics.append(packed_topic)
        with psycopg.connect(DSN) as c:
            packed_batch = tracker.open_batch(c, schema=schema)
            tracker.add_items(c, packed_batch, n, schema=schema)
            tracker.close_batch(c, packed_batch, schema=schema)
        out["stream_ack_packed"] = stream_scenario(
            spark, label, n, packed_batch.id, packed_topic, schema, partitions, checkpoints, packed=PACKED_PER_MESSAGE
        )
        say(f"{label} stream_ack_packed: {out['stream_ack_packed']}")

        sampler.phase = "dataframe_ack"
        with psycopg.connect(DSN) as c:
            other = tracker.open_batch(c, schema=schema)
            tracker.add_items(c, other, n, schema=schema)
            tracker.close_batch(c, other, schema=schema)
            c.commit()
            ids = ids_df(spark, c, schema, other.id, partitions)
        started = time.perf_counter()
        acked = tspark.ack_dataframe(ids, dsn=DSN, schema=schema)
        seconds = time.perf_counter() - started
        assert acked.acked == n and acked.completed == [other.id], (acked.acked, acked.completed)
        out["dataframe_ack"] = {"acks": n, "seconds": round(seconds, 2), "acks_per_s": round(n / seconds)}
        say(f"{label} dataframe_ack: {out['dataframe_ack']}")
        sampler.sample()
    finally:
        sampler.done.set()
        sampler.join()
        out["peak_rss_mib"] = sampler.peaks
        spark.stop()
        for f in admin.delete_topics(topics).values():
            try:
                f.result(30)
            except Exception:
                pass
    out["ratio_stream_vs_dataframe"] = round(out["stream_ack"]["acks_per_s"] / out["dataframe_ack"]["acks_per_s"], 2)
    out["ratio_stream_packed_vs_dataframe"] = round(
        out["stream_ack_packed"]["acks_per_s"] / out["dataframe_ack"]["acks_per_s"], 2
    )
    return out


def baselines(schema: str, sample: int) -> dict:
    out = {}
    with psycopg.connect(DSN) as c:
        b = tracker.open_batch(c, schema=schema)
        values = [b"item-%d" % i for i in range(sample)]
        started = time.perf_counter()
        outbox.enqueue(c, b, values, topic="bench-work", schema=schema)
        c.commit()
        out["enqueue_baseline"] = {"items": sample, "items_per_s": round(sample / (time.perf_counter() - started))}
        b = tracker.open_batch(c, schema=schema)
        handles = tracker.add_items(c, b, sample, schema=schema)
        c.commit()
        sample_ids = [i for h in handles for i in h.item_ids]
        started = time.perf_counter()
        tracker.ack(c, sample_ids, schema=schema)
        c.commit()
        out["direct_baseline"] = {"acks": sample, "acks_per_s": round(sample / (time.perf_counter() - started))}
    say(f"baselines: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000,000 rows instead of 10,000,000")
    ap.add_argument("--rows", type=int, help="rows to fan out and ids to ack (overrides --quick)")
    ap.add_argument(
        "--masters",
        default="cluster,local[2]",
        help="comma-separated: `cluster` (the local standalone cluster, or OUTBOX_SPARK_MASTER) and/or local[N]",
    )
    args = ap.parse_args(argv)
    n = args.rows or (1_000_000 if args.quick else 10_000_000)
    partitions = max(4, n // 500_000)
    jars = connector_jars()
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    schema_mod.migrate(DSN, schema)
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    work = tempfile.mkdtemp(prefix="bench-spark-")
    out: dict = {"bench": "spark", "rows": n, "load_avg_start": os.getloadavg()[0], "runs": {}}
    try:
        out.update(baselines(schema, 200_000 if n >= 1_000_000 else max(1, n // 5)))
        parquet = os.path.join(work, "items.parquet")
        # with the connector jars: every later SparkContext of this process shares this driver JVM
        writer = tspark.local_session("local[2]", jars=jars, app_name="bench-spark-input")
        writer.range(0, n, numPartitions=partitions).selectExpr(
            "CAST(concat('item-', id) AS BINARY) AS value"
        ).write.parquet(parquet)
        writer.stop()
        say(f"{n:,} rows written to {parquet} in {partitions} files")
        for label in args.masters.split(","):
            master, python = master_and_python() if label == "cluster" else (label, sys.executable)
            out["runs"][label] = run_master(
                label,
                master,
                python,
                n=n,
                parquet=parquet,
                partitions=partitions,
                schema=schema,
                jars=jars,
                admin=admin,
                checkpoints=os.path.join(work, "checkpoints"),
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    out["load_avg_end"] = os.getloadavg()[0]
    runs = out["runs"]
    first = runs[next(iter(runs))]
    out.update(
        {
            "fan_out_items_per_s": first["fan_out"]["items_per_s"],
            "stream_ack_acks_per_s": first["stream_ack"]["acks_per_s"],
            "dataframe_ack_acks_per_s": first["dataframe_ack"]["acks_per_s"],
            "ratio_stream_vs_dataframe": first["ratio_stream_vs_dataframe"],
            "stream_ack_packed_acks_per_s": first["stream_ack_packed"]["acks_per_s"],
            "ratio_stream_packed_vs_dataframe": first["ratio_stream_packed_vs_dataframe"],
            "ratio_fan_out_vs_enqueue": round(
                first["fan_out"]["items_per_s"] / out["enqueue_baseline"]["items_per_s"], 2
            ),
            "fan_out_meets_target": first["fan_out"]["items_per_s"] >= FAN_OUT_TARGET,
            "stream_meets_target": first["stream_ack"]["acks_per_s"] >= STREAM_TARGET
            and first["ratio_stream_vs_dataframe"] >= STREAM_RATIO_TARGET,
            "stream_packed_meets_target": first["stream_ack_packed"]["acks_per_s"] >= STREAM_TARGET
            and first["ratio_stream_packed_vs_dataframe"] >= STREAM_RATIO_TARGET,
        }
    )
    if len(runs) > 1:
        a, b = list(runs)[:2]
        out[f"ratio_{a}_vs_{b}"] = {
            k: round(
                runs[a][k]["items_per_s" if k == "fan_out" else "acks_per_s"]
                / runs[b][k]["items_per_s" if k == "fan_out" else "acks_per_s"],
                2,
            )
            for k in ("fan_out", "stream_ack", "stream_ack_packed", "dataframe_ack")
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
