"""Example Spark job: fan the rows of a Parquet dataset out into the outbox, tracked in one batch.

Ship it with the tracker zip (build it with `python deploy/spark/package.py dist`):

    spark-submit --master spark://HOST:7077 --py-files dist/tracker-<hash>.zip \\
        --conf spark.pyspark.python=/path/to/python-with-the-dependencies \\
        deploy/spark/fan_out_job.py --input /data/items.parquet --dsn postgresql://... \\
        --topic process-item --user-key catalog-42 --run-key catalog-42-2026-06-01

The driver and the executors import the tracker from the zip; their interpreter needs only the
dependencies (psycopg, pyarrow, ...). The DSN travels to the executors inside the job (each
partition writes its rows in one transaction of its own), so it must name a Postgres they can
reach. The batch's completion event goes through the outbox once every item is acked. Prints one
JSON line: batch_id, run, items, groups, complete.

`--run-key` names the job: submitting the same command again (after a failure, or a scheduler's
retry of a job that did finish) finds the batch the first submission opened and writes only the
partitions it had not committed, so every row is published once; a job that had finished writes
nothing and prints the same batch_id. Give each new fan-out a key of its own (the date of the data,
a version): a key names one job, and its user key and completion topic cannot change. The rows are
hashed into `--partitions` partitions by the columns written (`--value-col`, `--key-col`; one
shuffle) and sorted by them, so that a submission sees the same partitions as the last, whatever
cores the cluster has: raise it for a large input, as a Python worker holds one partition while it
writes it. `--partitions` is part of the job: a submission with the same `--run-key` and another
`--partitions` is refused (exit 2) before it writes, naming the count the key was first run with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True, help="Parquet file or folder")
    ap.add_argument("--dsn", default=os.environ.get("OUTBOX_DSN"), help="Postgres (default $OUTBOX_DSN)")
    ap.add_argument("--topic", required=True, help="topic of the fanned-out messages")
    ap.add_argument("--schema", help="the tracker's schema (default: reaper)")
    ap.add_argument("--value-col", default="value")
    ap.add_argument("--key-col")
    ap.add_argument("--user-key", help="returned in the completion event")
    ap.add_argument("--completion-topic")
    ap.add_argument(
        "--run-key",
        required=True,
        help="names this fan-out: submitted again with the same key, it writes only what is missing",
    )
    ap.add_argument(
        "--partitions",
        type=int,
        default=16,
        help="partitions the rows are hashed into, each written in one transaction (default 16)",
    )
    args = ap.parse_args(argv)
    if not args.dsn:
        ap.error("--dsn or OUTBOX_DSN is required")
    if args.partitions < 1:
        ap.error(f"--partitions must be at least 1, got {args.partitions}")

    from pyspark.sql import SparkSession

    from tracker import spark as tspark
    from tracker.spark.columns import check_column

    spark = SparkSession.builder.appName("tracker-fan-out").getOrCreate()
    try:
        df = spark.read.parquet(args.input)
        # A retried task, and this job submitted again, must find each partition holding the same
        # rows in the same order. How Spark splits the files depends on the cores it has at the
        # time; hashing the rows by their values, then sorting each partition, depends on the rows.
        # Only the written columns: Spark cannot order a map column, and rows alike in these give
        # the same message, so their order does not matter.
        written = [check_column(df, "value_col", args.value_col, ("binary", "string"))]
        if args.key_col is not None:
            written.append(check_column(df, "key_col", args.key_col, ("binary", "string")))
        df = df.repartition(args.partitions, *written).sortWithinPartitions(*written)
        result = tspark.fan_out(
            df,
            dsn=args.dsn,
            topic=args.topic,
            schema=args.schema,
            value_col=args.value_col,
            key_col=args.key_col,
            user_key=args.user_key,
            completion_topic=args.completion_topic,
            run_key=args.run_key,
        )
    except tspark.PartitionsChanged as exc:
        print(
            f"{ap.prog}: error: --partitions {args.partitions}: --run-key {args.run_key!r} was first submitted "
            f"with --partitions {exc.recorded} (batch {exc.batch_id}): submit it with --partitions {exc.recorded}, "
            "or give a new --run-key",
            file=sys.stderr,
            flush=True,
        )
        return 2
    finally:
        spark.stop()
    print(
        json.dumps(
            {
                "batch_id": result.batch_id,
                "run": result.run,
                "items": result.items,
                "groups": result.groups,
                "complete": result.complete,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
