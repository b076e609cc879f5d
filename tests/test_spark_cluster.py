"""tracker.spark on the standalone cluster: executors are separate processes that import the tracker
shipped with the job; executor loss in the middle of a fan-out and of a streaming-ack micro-batch,
and speculative copies of slow tasks, write nothing twice, lose nothing, complete once.

One application (SparkSession) for the module, with spark.speculation on: a task running 1.2x
longer than the median of its stage, and over 1 s, gets a copy once half of the stage is done.
Fast tasks are never speculated; the slow ones here are made slow on purpose.
"""

from __future__ import annotations

import json
import os
import sys
import time

import psycopg
import pytest
import support.spark as sspark
from confluent_kafka import Producer
from prometheus_client import REGISTRY
from pyspark import cloudpickle
from support.ci import skip_or_fail
from support.harness import wait_for
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker import spark as tspark

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

# The hooks run on the executors, which cannot import the tests: send them and their helpers by value.
cloudpickle.register_pickle_by_value(sspark)
cloudpickle.register_pickle_by_value(sys.modules[__name__])
kill_own_executor = sspark.kill_own_executor


@pytest.fixture(scope="module")
def spark(services):
    session = sspark.make_session(
        "tracker-cluster-tests",
        conf={
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "4",
            "spark.task.maxFailures": "4",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "5000",
            "spark.speculation": "true",
            "spark.speculation.minTaskRuntime": "1s",
            "spark.speculation.interval": "200ms",
            # judge slowness by run time alone: a slow task here has read its input at full speed
            "spark.speculation.efficiency.enabled": "false",
            "spark.speculation.quantile": "0.5",
            "spark.speculation.multiplier": "1.2",
        },
    )
    if not sspark.is_cluster(session):
        session.stop()
        skip_or_fail("executor loss needs a spark:// master; OUTBOX_SPARK_MASTER names a local one")
    yield session
    session.stop()


def _events(path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _record(path, event: str) -> None:
    with open(path, "a") as f:
        f.write(event + "\n")


def _all_planned_committed(checkpoint: str) -> bool:
    """Every micro-batch the query planned (offsets/N) has its commit (commits/N) in the checkpoint."""

    def ids(sub: str) -> set[int]:
        folder = os.path.join(checkpoint, sub)
        return {int(name) for name in os.listdir(folder) if name.isdigit()} if os.path.isdir(folder) else set()

    planned = ids("offsets")
    return bool(planned) and max(planned) == max(ids("commits"), default=-1)


def _offsets(value) -> dict[str, dict[str, int]]:
    return json.loads(value) if isinstance(value, str) else (value or {})


def _read_so_far(query) -> int:
    """Ack-topic offsets the query's micro-batches consumed (from each one's start and end offsets;
    a micro-batch's numInputRows is not that count when its foreachBatch runs several jobs on it).
    A query that failed raises its error here rather than leaving the caller to time out."""
    failure = query.exception()
    if failure is not None:
        raise AssertionError(f"the ack stream failed: {failure}")
    read = 0
    for progress in query.recentProgress:
        for source in progress["sources"]:
            start, end = _offsets(source["startOffset"]), _offsets(source["endOffset"])
            for topic, partitions in end.items():
                read += sum(int(o) - int(start.get(topic, {}).get(p, o)) for p, o in partitions.items())
    return read


def _once(marker) -> bool:
    """True the first time any process on this machine asks with this marker."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _ack_everything(spark, pg_dsn, schema, batch_id):
    """Ack every item id the outbox holds for the batch (one id per message, as consumers would)."""
    with psycopg.connect(pg_dsn) as c:
        ids = [
            bytes(r[0]).decode()
            for r in c.execute(
                f'SELECT header_values[1] FROM "{schema}".outbox WHERE header_values[2] = %s', [str(batch_id).encode()]
            )
        ]
    return tspark.ack_dataframe(
        spark.createDataFrame([(i,) for i in ids], "item_id string").repartition(4), dsn=pg_dsn, schema=schema
    )


def _assert_written_once(pg_dsn, schema, batch_id, n):
    with psycopg.connect(pg_dsn) as c:
        count, distinct_ids, distinct_values = c.execute(
            f'SELECT count(*), count(DISTINCT header_values[1]), count(DISTINCT value) FROM "{schema}".outbox '
            "WHERE topic = 'work'"
        ).fetchone()
        assert (count, distinct_ids, distinct_values) == (n, n, n)
        assert tracker.status(c, batch_id, schema=schema).total == n
        assert invariant_violations(c, schema) == []


def _assert_completed_once(pg_dsn, schema, batch_id):
    with psycopg.connect(pg_dsn) as c:
        st = tracker.status(c, batch_id, schema=schema)
        assert (st.state, st.pending) == ("complete", 0)
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_executors_are_processes_of_their_own_running_the_tracker_shipped_with_the_job(spark):
    def where(_):
        import tracker as t

        yield os.getpid(), sys.executable, t.__file__

    seen = spark.sparkContext.parallelize(range(8), 8).mapPartitions(where).collect()
    assert {pid for pid, _, _ in seen}.isdisjoint({os.getpid()})
    assert {exe for _, exe, _ in seen} == {spark.sparkContext.pythonExec} != {sys.executable}
    # the executors' interpreter has the dependencies but not the tracker: only the zip provides it
    assert all(".zip/tracker/__init__.py" in f for _, _, f in seen), seen
    assert len(sspark.executor_pids(spark.sparkContext.applicationId)) == 2  # one JVM on each worker


def test_fan_out_survives_executors_killed_inside_and_after_a_partition_transaction(spark, pg_dsn, schema, tmp_path):
    n, log = 40_000, tmp_path / "events"

    def die_inside(partition, attempt):  # writes done, not committed: Postgres aborts them
        if partition == 1 and _once(tmp_path / "inside"):
            _record(log, f"kill-inside:{partition}:{attempt}")
            kill_own_executor()
            os._exit(1)

    def die_after(partition, attempt):  # committed, never reported: the retry must write nothing
        _record(log, f"committed:{partition}:{attempt}")
        if partition == 2 and _once(tmp_path / "after"):
            _record(log, f"kill-after:{partition}:{attempt}")
            kill_own_executor()
            os._exit(1)

    df = spark.range(0, n, numPartitions=4).selectExpr("CAST(concat('payload-', id) AS BINARY) AS value")
    result = tspark.fan_out(
        df, dsn=pg_dsn, topic="work", schema=schema, user_key="loss", before_commit=die_inside, after_commit=die_after
    )
    events = _events(log)
    killed_inside = next(e for e in events if e.startswith("kill-inside:")).rsplit(":", 1)[1]
    assert f"committed:1:{killed_inside}" not in events  # that attempt never committed ...
    assert any(e.startswith("committed:1:") for e in events)  # ... a later one did
    assert sum(e.startswith("committed:2:") for e in events) >= 2  # partition 2: committed, then its retry
    assert (result.items, result.groups) == (n, 8)
    _assert_written_once(pg_dsn, schema, result.batch_id, n)
    acked = _ack_everything(spark, pg_dsn, schema, result.batch_id)
    assert acked.acked == n
    _assert_completed_once(pg_dsn, schema, result.batch_id)


def test_ack_stream_survives_an_executor_lost_mid_micro_batch_and_restarts_from_its_checkpoint(
    spark, pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    n, topic, marker = 20_000, topics("acks", partitions=2), tmp_path / "killed"
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        ids = [i for h in tracker.add_items(c, batch, n, schema=schema) for i in h.item_ids]
        tracker.close_batch(c, batch, schema=schema)
        c.commit()
    p = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 20})

    def produce(chunk):
        for i in chunk:
            p.produce(topic, key=str(batch.id).encode(), value=i.encode())
        assert p.flush(30) == 0

    def die_once_after_applying(partition, attempt):  # the micro-batch's masks are committed, unreported
        if _once(marker):
            kill_own_executor()
            os._exit(1)

    checkpoint = str(tmp_path / "checkpoint")
    produce(ids[: n // 2])
    query, first = tspark.ack_stream(
        spark,
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        dsn=pg_dsn,
        schema=schema,
        checkpoint_location=checkpoint,
        max_offsets_per_trigger=2500,
        after_apply=die_once_after_applying,
    )
    try:
        wait_for(lambda: first.acked + first.duplicates >= n // 2, timeout=300, what="the first half of the acks")
        # foreachBatch has returned before Spark writes the micro-batch's commit; stopping in between
        # re-reads that micro-batch on restart (an allowed duplicate, but not what this test checks)
        wait_for(lambda: _all_planned_committed(checkpoint), timeout=60, what="the first query's last commit")
    finally:
        query.stop()
    assert marker.exists() and first.batches >= 4
    # The killed task's masks were committed before it died; its retry found them applied.
    assert first.duplicates > 0 and first.acked + first.duplicates == n // 2
    with psycopg.connect(pg_dsn) as c:
        assert tracker.status(c, batch, schema=schema).pending == n - n // 2

    produce(ids[n // 2 :])
    query, second = tspark.ack_stream(
        spark,
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        dsn=pg_dsn,
        schema=schema,
        checkpoint_location=checkpoint,
        max_offsets_per_trigger=2500,
    )
    try:
        wait_for(lambda: second.acked >= n - n // 2, timeout=300, what="the second half of the acks")
        # a micro-batch's progress is recorded after its foreachBatch returns
        wait_for(lambda: _read_so_far(query) >= n - n // 2, timeout=180, what="the last micro-batch's progress")
        read = _read_so_far(query)
    finally:
        query.stop()
    # From the checkpoint: only the new half was read, and none of it had been applied.
    assert (read, second.acked, second.duplicates) == (n - n // 2, n - n // 2, 0)
    # progress, as the StreamingQueryListener reported it: rows, micro-batch time, lag, Prometheus
    assert second.progress.input_rows == n - n // 2  # counted by the stream itself, every micro-batch whole
    wait_for(lambda: second.progress.lag == 0, timeout=30, what="the listener's last progress")
    assert second.progress.busy_seconds > 0
    assert REGISTRY.get_sample_value("reaper_spark_stream_input_rows_total", {"query": topic}) >= n
    _assert_completed_once(pg_dsn, schema, batch.id)


def _wait_for_copy(log, event: str, timeout: float = 120) -> None:
    """Stay slow until the speculative copy has done its work (or give up: the test then fails)."""
    deadline = time.monotonic() + timeout
    while event not in _events(log) and time.monotonic() < deadline:
        time.sleep(0.2)


def test_speculative_copies_of_slow_tasks_write_and_ack_once(spark, pg_dsn, schema, tmp_path):
    n, log = 16_000, tmp_path / "attempts"

    def slow_after(partition, attempt):  # committed: the copy finds the groups and writes nothing
        _record(log, f"done:{partition}:{attempt}")
        if (partition, attempt) == (7, 0):
            _wait_for_copy(log, "done:7:1")

    df = spark.range(0, n, numPartitions=8).selectExpr("CAST(concat('payload-', id) AS BINARY) AS value")
    result = tspark.fan_out(df, dsn=pg_dsn, topic="work", schema=schema, after_commit=slow_after)
    assert "done:7:1" in _events(log)  # partition 7's copy ran (and wrote nothing: checked below)
    assert (result.items, result.groups) == (n, 8)
    _assert_written_once(pg_dsn, schema, result.batch_id, n)

    def slow_apply(partition, attempt):  # masks are partitioned by batch: one task applies them all
        _record(log, f"apply:{partition}:{attempt}")
        if attempt == 0 and _once(tmp_path / "slow-apply"):
            _wait_for_copy(log, f"apply:{partition}:1")

    with psycopg.connect(pg_dsn) as c:
        ids = [bytes(r[0]).decode() for r in c.execute(f'SELECT header_values[1] FROM "{schema}".outbox')]
    acked = tspark.ack_dataframe(
        spark.createDataFrame([(i,) for i in ids], "item_id string").repartition(4),
        dsn=pg_dsn,
        schema=schema,
        after_apply=slow_apply,
    )
    assert any(e.startswith("apply:") and e.endswith(":1") for e in _events(log))  # a copy applied them again
    assert acked.acked + acked.duplicates == n
    _assert_completed_once(pg_dsn, schema, result.batch_id)


def test_spark_submit_of_the_example_job_fans_a_parquet_dataset_out_to_a_completion_event(
    spark, pg_dsn, schema, tmp_path
):
    import json
    import subprocess
    from pathlib import Path

    import pyspark

    n, parquet = 12_000, str(tmp_path / "items.parquet")
    spark.range(0, n, numPartitions=3).selectExpr(
        "concat('item-', id) AS value", "concat('k', id % 10) AS key"
    ).write.parquet(parquet)
    zip_path = tspark.tracker_zip(tmp_path / "dist")
    master, node_python = sspark.master_and_python()
    spark_submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK", "PYTHON", "SPARK_"))}

    def submit() -> dict:
        r = subprocess.run(
            [
                str(spark_submit),
                "--master",
                master,
                "--py-files",
                str(zip_path),
                "--driver-memory",
                "512m",
                "--conf",
                f"spark.pyspark.python={node_python}",
                "--conf",
                "spark.executor.memory=1g",
                "--conf",
                "spark.cores.max=2",
                "--conf",
                "spark.driver.host=127.0.0.1",
                "--conf",
                f"spark.driver.extraJavaOptions={sspark.FAST_JVM}",
                "--conf",
                f"spark.executor.extraJavaOptions={sspark.FAST_JVM}",
                str(sspark.REPO / "deploy" / "spark" / "fan_out_job.py"),
                "--input",
                parquet,
                "--dsn",
                pg_dsn,
                "--schema",
                schema,
                "--topic",
                "work",
                "--key-col",
                "key",
                "--user-key",
                "submitted",
                "--run-key",
                "submitted-1",
                "--partitions",
                "4",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert r.returncode == 0, r.stderr[-4000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    out = submit()
    assert (out["run"], out["items"], out["groups"], out["complete"]) == (0, n, 4, False)  # hashed into 4
    # The same command again (a scheduler's retry): it finds its batch and writes nothing.
    assert submit() == out
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(
            f'SELECT key, value, header_values[1] FROM "{schema}".outbox WHERE topic = %s', ["work"]
        ).fetchall()
        assert sorted(bytes(v).decode() for _, v, _ in rows) == sorted(f"item-{i}" for i in range(n))
        assert all(bytes(k).decode() == "k" + bytes(v).decode().rsplit("-", 1)[1][-1] for k, v, _ in rows)
        # consumers ack every item in their own transactions: the batch completes, one event
        for k in range(0, n, 4000):
            tracker.ack(c, [bytes(i).decode() for _, _, i in rows[k : k + 4000]], schema=schema)
            c.commit()
        assert [json.loads(v)["user_key"] for _, v in completion_events(c, schema)] == ["submitted"]
    _assert_completed_once(pg_dsn, schema, out["batch_id"])


def test_outcomes_survive_an_executor_lost_after_committing_failures(spark, pg_dsn, schema, tmp_path):
    """An executor dies right after a partition of failures committed: the retry records nothing
    twice, the acks that follow finish the batch, once, with exact counts."""
    n, log = 12_000, tmp_path / "events"
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, completion_topic="cluster-outcomes", tolerated_failures=n, schema=schema)
        tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()

    def die_after(partition, attempt):
        _record(log, f"applied:{partition}:{attempt}")
        if _once(tmp_path / "after"):
            _record(log, f"kill-after:{partition}:{attempt}")
            kill_own_executor()
            os._exit(1)

    gid = lambda k: f"{b.id}:{k // 8192}:{k % 8192}"  # noqa: E731
    rows = [(gid(k), "failed", f"reason {k % 5}") if k % 4 == 0 else (gid(k), "succeeded", None) for k in range(n)]
    df = spark.createDataFrame(rows, "item_id string, outcome string, reason string").repartition(4)
    got = tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema, after_apply=die_after)
    events = _events(log)
    killed = next(e for e in events if e.startswith("kill-after:"))
    partition = killed.split(":")[1]
    # one batch: its masks are applied by one partition, so its failures ran, were killed after
    # committing, ran again (a stage resubmitted after losing an executor counts attempts from 0),
    # then its acks ran
    assert sum(e.startswith(f"applied:{partition}:") for e in events) == 3, events
    assert got.failed + got.succeeded + got.duplicates == n  # a retried commit reports duplicates
    with psycopg.connect(pg_dsn) as c:
        st = tracker.status(c, b, schema=schema)
        assert (st.state, st.outcome, st.failed, st.succeeded, st.pending) == (
            "complete",
            "failed",
            n // 4,
            n - n // 4,
            0,
        )
        assert invariant_violations(c, schema) == []
        assert len(completion_events(c, schema, "cluster-outcomes")) == 1
        failed = tracker.failures(c, b, limit=1000, schema=schema)
        assert failed.items[:3] == [(gid(0), "reason 0"), (gid(4), "reason 4"), (gid(8), "reason 3")]
