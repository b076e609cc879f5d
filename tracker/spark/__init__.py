"""Spark: fan a DataFrame out into the outbox, ack a DataFrame of item ids, and a streaming ack job.

    from tracker import spark as tspark
    spark = tspark.session("spark://host:7077", python="/opt/venv/bin/python")  # ships the tracker
    result = tspark.fan_out(df, dsn=dsn, topic="process-item", user_key="catalog-42")
    tspark.ack_dataframe(acks_df, dsn=dsn)
    tspark.outcome_dataframe(outcomes_df, dsn=dsn)  # item_id, outcome ('succeeded'/'failed'), reason
    query, totals = tspark.ack_stream(spark, bootstrap_servers=..., topic="acks", dsn=dsn,
                                      checkpoint_location="/checkpoints/acks")

fanout.py: the fan-out and its exactly-once partition write; runs.py: its runs, and the batch of a
job's run key; acks.py: DataFrame acks (fold, OR, apply); outcomes.py: a DataFrame of outcomes
(failures folded per reason, then acks); stream.py: streaming acks and failures from the ack topic
(in each partition's order, as the acker applies them) and their progress; cluster.py: sessions
and shipping the tracker to executors.
pyspark is imported only when a job runs.
"""

from tracker.spark.acks import AckTotals, ack_dataframe
from tracker.spark.cluster import local_session, session, tracker_zip
from tracker.spark.fanout import (  # noqa: F401
    MAX_CHUNKS,
    MAX_PARTITIONS,
    MAX_RUNS,
    SPARK_GROUP_FLAG,
    FanOutResult,
    _PartitionWriter,
    fan_out,
    run_group_range,
    spark_group_id,
)
from tracker.spark.outcomes import OutcomeTotals, outcome_dataframe
from tracker.spark.runs import PartitionsChanged, begin_run
from tracker.spark.stream import OrderedTotals, StreamTotals, ack_stream, ordered_outcomes

__all__ = [
    "fan_out",
    "FanOutResult",
    "begin_run",
    "PartitionsChanged",
    "spark_group_id",
    "run_group_range",
    "SPARK_GROUP_FLAG",
    "MAX_RUNS",
    "MAX_PARTITIONS",
    "MAX_CHUNKS",
    "ack_dataframe",
    "AckTotals",
    "outcome_dataframe",
    "OutcomeTotals",
    "ack_stream",
    "StreamTotals",
    "ordered_outcomes",
    "OrderedTotals",
    "session",
    "local_session",
    "tracker_zip",
]
