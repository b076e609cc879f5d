"""Progress of streaming ack queries: rows/s, micro-batch duration and lag, as Prometheus metrics
and structlog lines, from a StreamingQueryListener on the driver.

Lag is the Kafka source's `maxOffsetsBehindLatest`: ack messages on the topic that the query has
not read yet (the largest of its partitions). One label, the query's name: a job runs few queries.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import structlog
from prometheus_client import Counter, Gauge, Histogram

input_rows = Counter("reaper_spark_stream_input_rows_total", "Ack messages read by a Spark ack stream", ["query"])
rows_per_second = Gauge(
    "reaper_spark_stream_rows_per_second", "Ack messages processed per second in the last micro-batch", ["query"]
)
batch_duration = Histogram(
    "reaper_spark_stream_batch_duration_seconds",
    "Duration of one micro-batch",
    ["query"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
dead_lettered = Counter(
    "reaper_spark_stream_acks_dead_lettered_total", "Ack messages a Spark ack stream sent to the dead-letter topic"
)
lag = Gauge(
    "reaper_spark_stream_lag_messages",
    "Ack messages on the topic not yet read by the stream (largest partition)",
    ["query"],
)

log = structlog.get_logger("tracker.spark.stream")


@dataclass
class Progress:
    """The latest micro-batch of one query, as the listener saw it."""

    batches: int = 0
    input_rows: int = 0
    rows_per_second: float = 0.0
    batch_seconds: float = 0.0
    busy_seconds: float = 0.0  # sum of micro-batch durations (rows / busy = steady rate)
    lag: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def _lag_of(progress: Any) -> int | None:
    behind = [
        int(float(s.metrics["maxOffsetsBehindLatest"]))
        for s in progress.sources
        if s.metrics and s.metrics.get("maxOffsetsBehindLatest") is not None
    ]
    return max(behind) if behind else None


def record_input_rows(progress: Progress, label: str, rows: int) -> None:
    """Ack messages one micro-batch read, as counted by the stream itself (the listener's
    numInputRows misses rows an earlier job of the micro-batch read into its cache)."""
    with progress.lock:
        progress.input_rows += rows
    input_rows.labels(label).inc(rows)


def listener(query_id_holder: list, label: str, progress: Progress) -> Any:
    """A StreamingQueryListener that reports the query whose id is put in `query_id_holder`."""
    from pyspark.sql.streaming import StreamingQueryListener

    class AckStreamProgress(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:
            pass

        def onQueryProgress(self, event: Any) -> None:
            p = event.progress
            if not query_id_holder or str(p.id) != query_id_holder[0]:
                return
            seconds = p.batchDuration / 1000
            behind = _lag_of(p)
            with progress.lock:
                progress.batches += 1
                progress.rows_per_second = p.processedRowsPerSecond
                progress.batch_seconds = seconds
                if p.numInputRows:
                    progress.busy_seconds += seconds
                progress.lag = behind
            rows_per_second.labels(label).set(p.processedRowsPerSecond)
            batch_duration.labels(label).observe(seconds)
            if behind is not None:
                lag.labels(label).set(behind)
            if p.numInputRows:
                log.info(
                    "ack stream micro-batch",
                    query=label,
                    batch=p.batchId,
                    spark_input_rows=p.numInputRows,  # what its last job read from Kafka
                    rows_per_s=round(p.processedRowsPerSecond),
                    seconds=seconds,
                    lag=behind,
                )

        def onQueryIdle(self, event: Any) -> None:
            pass

        def onQueryTerminated(self, event: Any) -> None:
            pass

    return AckStreamProgress()
