"""tracker.spark on the local Spark standalone cluster (or OUTBOX_SPARK_MASTER, e.g. local[2,2])
against the real Postgres and Kafka: fan-out, retries, bulk and streaming acks.

One SparkSession for the whole module (they are slow to start), with up to two attempts per task,
so a task that fails once is retried.
"""

from __future__ import annotations

import json
import threading

import psycopg
import pytest
from confluent_kafka import Producer
from support.acking import make_acker, running
from support.harness import read_messages, wait_for
from support.spark import make_session
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker import spark as tspark
from tracker.consumer import AckProducer

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def spark(services):
    session = make_session(
        "tracker-tests",
        conf={
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "4",
            "spark.task.maxFailures": "2",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "5000",
        },
    )
    yield session
    session.stop()


def _items(spark, n, partitions):
    return spark.range(0, n, numPartitions=partitions).selectExpr(
        "CAST(concat('payload-', id) AS BINARY) AS value",
        "CASE WHEN id % 7 = 0 THEN NULL ELSE concat('k', id % 7) END AS key",
        "id",
    )  # some rows without a key


def _outbox(pg_dsn, schema, topic):
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            f'SELECT key, value, header_keys, header_values FROM "{schema}".outbox WHERE topic = %s', [topic]
        ).fetchall()


def _groups(pg_dsn, schema, batch_id):
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            f'SELECT id, size, pending FROM "{schema}".batch_group WHERE batch_id = %s ORDER BY id', [batch_id]
        ).fetchall()


def test_fan_out_writes_each_row_once_with_groups_and_closes(spark, pg_dsn, schema):
    n = 30_000
    df = _items(spark, n, 3)
    with psycopg.connect(pg_dsn) as c:  # counter-allocated groups coexist with Spark's
        batch = tracker.open_batch(c, user_key="spark-1", schema=schema)
        tracker.add_items(c, batch, 5, schema=schema)
        c.commit()
    result = tspark.fan_out(df, dsn=pg_dsn, topic="work", schema=schema, batch=batch, key_col="key", id_col="item_id")
    assert (result.batch_id, result.run, result.items, result.complete) == (batch.id, 0, n, False)
    groups = _groups(pg_dsn, schema, batch.id)
    assert groups[0] == (0, 5, 5)
    spark_groups = groups[1:]
    assert len(spark_groups) == result.groups == 6  # 3 partitions of 10,000 rows: 2 groups each
    assert sum(size for _, size, _ in spark_groups) == n
    assert all(g >= tspark.SPARK_GROUP_FLAG for g, _, _ in spark_groups)
    rows = _outbox(pg_dsn, schema, "work")
    assert len(rows) == n
    ids = {hv[0].decode() for _, _, _, hv in rows}
    assert len(ids) == n and all(hk == ["item-id", "batch-id"] for _, _, hk, _ in rows)
    by_value = {v: (k, hv[0].decode()) for k, v, _, hv in rows}
    out = {bytes(r.value): (r.key, r.item_id) for r in result.dataframe.select("value", "key", "item_id").collect()}
    assert {v: (k and k.encode(), i) for v, (k, i) in out.items()} == by_value  # returned ids = written ids
    assert sum(k is None for k, _ in by_value.values()) == len([i for i in range(n) if i % 7 == 0])
    with psycopg.connect(pg_dsn) as c:
        st = tracker.status(c, batch, schema=schema)
        assert (st.state, st.total, st.pending) == ("closed", n + 5, n + 5)
        assert invariant_violations(c, schema) == []


def test_a_task_that_fails_once_after_commit_leaves_one_set_of_groups_and_messages(spark, pg_dsn, schema, tmp_path):
    n = 30_000
    log = tmp_path / "attempts"  # local executors share this file system; accumulators drop failed tasks

    def fail_first_attempt(partition, attempt):
        with open(log, "a") as f:
            f.write(f"{partition}:{attempt}\n")
        if attempt == 0 and partition == 1:
            raise RuntimeError("injected: task dies after its transaction committed")

    result = tspark.fan_out(
        _items(spark, n, 3), dsn=pg_dsn, topic="work", schema=schema, after_commit=fail_first_attempt
    )
    assert sorted(log.read_text().split()) == ["0:0", "1:0", "1:1", "2:0"]  # partition 1 committed, died, ran again
    assert (result.items, result.groups) == (n, 6)
    rows = _outbox(pg_dsn, schema, "work")
    assert len(rows) == n and len({hv[0] for *_, hv in rows}) == n
    assert len({v for _, v, _, _ in rows}) == n
    with psycopg.connect(pg_dsn) as c:
        assert tracker.status(c, result.batch_id, schema=schema).total == n
        assert invariant_violations(c, schema) == []


def test_a_failed_job_rerun_with_its_run_key_completes_without_duplicates(spark, pg_dsn, schema):
    n = 12_000
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        c.commit()

    def always_fail_partition_2(partition, attempt):
        if partition == 2:
            raise RuntimeError("injected: partition 2 keeps failing")

    with pytest.raises(Exception, match="partition 2 keeps failing"):
        tspark.fan_out(
            _items(spark, n, 4),
            dsn=pg_dsn,
            topic="work",
            schema=schema,
            batch=batch,
            run_key="job-1",
            after_commit=always_fail_partition_2,
        )
    assert len(_outbox(pg_dsn, schema, "work")) >= 3000  # committed partitions stay
    result = tspark.fan_out(_items(spark, n, 4), dsn=pg_dsn, topic="work", schema=schema, batch=batch, run_key="job-1")
    assert (result.run, result.items, result.groups) == (0, n, 4)
    rows = _outbox(pg_dsn, schema, "work")
    assert len(rows) == n and len({hv[0] for *_, hv in rows}) == n
    with psycopg.connect(pg_dsn) as c:
        st = tracker.status(c, batch, schema=schema)
        assert (st.state, st.total) == ("closed", n)
        with pytest.raises(tracker.BatchNotOpen):
            tspark.begin_run(c, batch.id, schema=schema)


def test_ack_dataframe_folds_per_group_and_is_idempotent(spark, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        handles = tracker.add_items(c, batch, 20_000, schema=schema)
        tracker.close_batch(c, batch, schema=schema)
        c.commit()
    ids = [i for h in handles for i in h.item_ids]
    b = batch.id
    rows = ids[:10_000] + ids[:500] + [f"{b}:1:0-8191", f"{b}:2:{len(handles[2].item_ids) - 1}"] + ids[16_384:]
    bad = ["nonsense", f"{b}:9:0", "424242:0:0", f"{b}:2:9000"]
    df = spark.createDataFrame([(r,) for r in rows + bad], "item_id string").repartition(5)
    totals = tspark.ack_dataframe(df, dsn=pg_dsn, schema=schema)
    assert totals.acked == 20_000 and totals.completed == [b]
    assert sorted(r for r, _ in totals.rejected) == sorted(bad)
    reasons = dict(totals.rejected)
    assert reasons["nonsense"].startswith("malformed") and reasons[f"{b}:9:0"] == "unknown group"
    assert reasons["424242:0:0"] == "unknown batch" and reasons[f"{b}:2:9000"].startswith("index out of range")
    again = tspark.ack_dataframe(df, dsn=pg_dsn, schema=schema)
    assert (again.acked, again.completed) == (0, [])
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_streaming_ack_job_applies_micro_batches_and_replays_change_nothing(
    spark, pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        (h,) = tracker.add_items(c, batch, 3000, schema=schema)
        tracker.close_batch(c, batch, schema=schema)
        c.commit()
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in h.item_ids[:2000]:  # single ids
        p.produce(topic, key=str(batch.id).encode(), value=i.encode())
    p.produce(topic, key=b"x", value=b"garbage")
    assert p.flush(30) == 0
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic) as acks:  # the rest as runs
        acks.ack(h.item_ids[1500:])
    query, totals = tspark.ack_stream(
        spark,
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        dsn=pg_dsn,
        schema=schema,
        checkpoint_location=str(tmp_path / "cp1"),
        dead_letter_topic=dlq,
        max_offsets_per_trigger=700,
        trigger_interval="200 milliseconds",
    )
    try:
        wait_for(
            lambda: totals.completed_count == 1 and totals.rejected_count, timeout=180, what="the stream to complete"
        )
    finally:
        query.stop()
    assert totals.acked == 3000 and totals.batches >= 2
    letters = read_messages(kafka_bootstrap, dlq, 1)
    assert [(m.value(), dict(m.headers())["reason"][:9]) for m in letters] == [(b"garbage", b"malformed")]
    # A new checkpoint replays the whole topic: nothing changes.
    replay, again = tspark.ack_stream(
        spark,
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        dsn=pg_dsn,
        schema=schema,
        checkpoint_location=str(tmp_path / "cp2"),
    )
    try:
        wait_for(lambda: again.duplicates >= 3500, timeout=180, what="the replay")
    finally:
        replay.stop()
    assert (again.acked, again.completed_count) == (0, 0)
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []


def test_batch_completes_once_with_acks_through_acker_direct_path_and_spark_at_once(
    spark, pg_dsn, schema, kafka_bootstrap, topics
):
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        handles = tracker.add_items(c, batch, 30_000, schema=schema)
        tracker.close_batch(c, batch, schema=schema)
        c.commit()
    ids = [i for h in handles for i in h.item_ids]
    # three overlapping thirds: every id is acked by at least one path, many by two
    via_kafka, via_direct, via_spark = ids[:12_000], ids[9_000:21_000], ids[18_000:]
    with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic) as acks:
        acks.ack(via_kafka)
    direct_acked = []

    def direct():
        with psycopg.connect(pg_dsn) as c:
            for k in range(0, len(via_direct), 500):
                # the masked path: `acked` counts the bits this call cleared (a claim counts a bit set
                # when claimed, which another path may clear before the claim settles)
                direct_acked.append(tracker.ack(c, via_direct[k : k + 500], schema=schema, claims=False).acked)
                c.commit()

    df = spark.createDataFrame([(i,) for i in via_spark], "item_id string").repartition(4)
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, max_poll_records=200)
    t = threading.Thread(target=direct)
    with running(acker):
        t.start()
        totals = tspark.ack_dataframe(df, dsn=pg_dsn, schema=schema)
        t.join(120)
        wait_for(
            lambda: tracker.status(psycopg.connect(pg_dsn), batch, schema=schema).state == "complete",
            what="the batch to complete",
        )
        assert not t.is_alive()
    with psycopg.connect(pg_dsn) as c:
        st = tracker.status(c, batch, schema=schema)
        assert (st.state, st.pending) == ("complete", 0)
        assert len(completion_events(c, schema)) == 1
        assert invariant_violations(c, schema) == []
    assert totals.rejected == []
    assert acker.stats["acked"] + sum(direct_acked) + totals.acked == 30_000  # every bit flipped exactly once
    assert acker.stats["completed"] + (totals.completed == [batch.id]) <= 1


def test_fan_out_of_an_empty_dataframe_completes_the_batch(spark, pg_dsn, schema):
    result = tspark.fan_out(
        spark.range(0, 0, numPartitions=2).selectExpr("CAST(id AS STRING) AS value"),
        dsn=pg_dsn,
        topic="work",
        schema=schema,
        user_key="empty",
    )
    assert (result.items, result.groups, result.complete) == (0, 0, True)
    with psycopg.connect(pg_dsn) as c:
        assert [json.loads(v)["user_key"] for _, v in completion_events(c, schema)] == ["empty"]


def _fail_every_apply(partition, attempt):
    raise RuntimeError("the database went away after the apply")


def test_a_failed_micro_batch_retried_from_its_checkpoint_counts_its_input_rows_once(
    spark, pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    from tracker.spark.progress import input_rows

    topic, name = topics("acks"), f"once-{schema}"
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        (h,) = tracker.add_items(c, batch, 50, schema=schema)
        tracker.close_batch(c, batch, schema=schema)
        c.commit()
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for i in h.item_ids:
        p.produce(topic, key=str(batch.id).encode(), value=i.encode())
    assert p.flush(30) == 0
    counted = input_rows.labels(name)
    before = counted._value.get()
    kw = {
        "bootstrap_servers": kafka_bootstrap,
        "topic": topic,
        "dsn": pg_dsn,
        "schema": schema,
        "checkpoint_location": str(tmp_path / "cp"),
        "query_name": name,
    }
    query, first = tspark.ack_stream(spark, **kw, after_apply=_fail_every_apply)
    try:
        wait_for(lambda: query.exception() is not None, timeout=180, what="the micro-batch to fail")
    finally:
        query.stop()
    query, second = tspark.ack_stream(spark, **kw)  # the same micro-batch again, from the checkpoint
    try:
        wait_for(lambda: second.completed_count == 1, timeout=180, what="the retried micro-batch")
    finally:
        query.stop()
    assert counted._value.get() - before == 50
    assert first.progress.input_rows + second.progress.input_rows == 50


def _state(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(f'SELECT count(*) FROM "{schema}".{table}').fetchone()[0]
            for table in ("batch", "batch_group", "outbox", "spark_fanout_run")
        ]


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"topic": "bad topic!"}, tracker.InvalidValue, "topic"),
        ({"topic": "t" * 250}, tracker.InvalidValue, "topic"),
        ({"value_col": "id"}, tracker.InvalidValue, "value_col"),  # a bigint column
        ({"value_col": "nowhere"}, tracker.InvalidValue, "value_col"),
        ({"key_col": "id"}, tracker.InvalidValue, "key_col"),
        ({"id_col": "value"}, tracker.InvalidValue, "id_col"),  # would clash with the input's column
        ({"id_col": ""}, tracker.InvalidArgument, "id_col"),
        ({"user_key": "k" * 1001}, tracker.InvalidValue, "user_key"),
    ],
)
def test_fan_out_refuses_bad_input_before_writing_anything(spark, pg_dsn, schema, kwargs, error, name):
    before = _state(pg_dsn, schema)
    with pytest.raises(error) as info:
        tspark.fan_out(_items(spark, 3, 1), **{"dsn": pg_dsn, "schema": schema, "topic": "fan", **kwargs})
    assert str(info.value).startswith(name + " ")
    assert _state(pg_dsn, schema) == before  # no batch opened, no run begun, nothing written


def test_fan_out_refuses_too_many_partitions_before_writing_anything(spark, pg_dsn, schema):
    from tracker.spark.fanout import MAX_PARTITIONS

    before = _state(pg_dsn, schema)
    with pytest.raises(tracker.InvalidValue, match=f"at most {MAX_PARTITIONS} partitions"):
        tspark.fan_out(
            spark.range(0, 1, numPartitions=MAX_PARTITIONS + 1).selectExpr("CAST(id AS STRING) AS value"),
            dsn=pg_dsn,
            schema=schema,
            topic="fan",
        )
    assert _state(pg_dsn, schema) == before


def test_ack_dataframe_refuses_a_column_that_holds_no_item_ids(spark, pg_dsn, schema):
    with pytest.raises(
        tracker.InvalidValue, match="column 'id': is a bigint column: a string or binary column is needed"
    ):
        tspark.ack_dataframe(spark.range(0, 3).selectExpr("id"), dsn=pg_dsn, schema=schema, column="id")
