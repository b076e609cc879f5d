"""Example Spark job: fan the rows of a Parquet dataset out into the outbox, tracked in one batch.

Ship it with the tracker zip (build it with `python deploy/spark/package.py dist`):

    spark-submit --master spark://HOST:7077 --py-files dist/tracker-<hash>.zip \\
        --conf spark.pyspark.python=/path/to/python-with-the-dependencies \\
        deploy/spark/fan_out_job.py --input /data/items.parquet --dsn postgresql://... \\
        --topic process-item --user-key catalog-42

The driver and the executors import the tracker from the zip; their interpreter needs only the
dependencies (psycopg, pyarrow, ...). The DSN travels to the executors inside the job (each
partition writes its rows in one transaction of its own), so it must name a Postgres they can
reach. The batch's completion event goes through the outbox once every item is acked. Prints one
JSON line: batch_id, run, items, groups. `--run-key` makes a re-submitted job skip what a failed
attempt already wrote.
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
    ap.add_argument("--run-key", help="re-running with the same key skips partitions already written")
    ap.add_argument("--partitions", type=int, help="repartition the input first (rows are read in order)")
    args = ap.parse_args(argv)
    if not args.dsn:
        ap.error("--dsn or OUTBOX_DSN is required")

    from pyspark.sql import SparkSession

    from tracker import spark as tspark

    spark = SparkSession.builder.appName("tracker-fan-out").getOrCreate()
    try:
        df = spark.read.parquet(args.input)
        if args.partitions:
            # a retried partition must hold the same rows in the same order: sort within partitions
            df = df.repartition(args.partitions).sortWithinPartitions(*df.columns)
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
