"""tracker.spark.outcome_dataframe against the real Postgres (and the standalone cluster, or
OUTBOX_SPARK_MASTER, e.g. local[2,2]): failures grouped per reason and acks through the executors'
per-partition fold, idempotent, deterministic whatever the partitioning, bad values refused whole."""

from __future__ import annotations

import json

import psycopg
import pytest
from support.spark import make_session
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker import spark as tspark
from tracker.errors import InvalidValue

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def spark(services):
    session = make_session(
        "tracker-outcome-tests",
        conf={
            "spark.sql.shuffle.partitions": "4",
            "spark.default.parallelism": "4",
            "spark.task.maxFailures": "2",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "700",
        },
        kafka=False,
    )
    yield session
    session.stop()


def _batch(pg_dsn, schema, n, **opened):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, schema=schema, **opened)
        tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    return b.id


def _failures(pg_dsn, schema, batch_id):
    out, after = [], None
    with psycopg.connect(pg_dsn) as c:
        while True:
            page = tracker.failures(c, batch_id, after=after, limit=1000, schema=schema)
            out += page.items
            if page.next is None:
                return out
            after = page.next


def test_outcomes_of_a_dataframe_fail_per_reason_ack_the_rest_and_complete_once(spark, pg_dsn, schema):
    n = 20_000  # 3 groups
    b = _batch(pg_dsn, schema, n, completion_topic="spark-outcomes")
    gid = lambda k: f"{b}:{k // 8192}:{k % 8192}"  # noqa: E731
    reasons = ["timeout", "bad row", "no stock"]
    rows = [(gid(k), "failed", reasons[k % 3]) if k % 10 == 0 else (gid(k), "succeeded", None) for k in range(n)]
    rows += [("nope", "succeeded", None), (f"{b}:9:0", "failed", "timeout")]  # bad ids: rejected, not applied
    df = spark.createDataFrame(rows, "item_id string, outcome string, reason string").repartition(5)
    got = tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema)
    assert (got.failed, got.succeeded, got.duplicates, got.completed) == (n // 10, n - n // 10, 0, [b])
    assert sorted(r[0] for r in got.rejected) == [f"{b}:9:0", "nope"]
    assert dict(got.rejected)[f"{b}:9:0"] == "unknown group" and "malformed" in dict(got.rejected)["nope"]
    failed = _failures(pg_dsn, schema, b)
    assert failed == [(gid(k), reasons[k % 3]) for k in range(0, n, 10)]
    with psycopg.connect(pg_dsn) as c:
        st = tracker.status(c, b, schema=schema)
        assert (st.state, st.outcome, st.failed, st.succeeded, st.pending) == (
            "complete",
            "failed",
            n // 10,
            n - n // 10,
            0,
        )
        assert invariant_violations(c, schema) == []
        events = [json.loads(bytes(v)) for _, v in completion_events(c, schema, "spark-outcomes")]
        assert len(events) == 1 and (events[0]["outcome"], events[0]["failed"]) == ("failed", n // 10)
    again = tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema)  # idempotent: nothing new
    assert (again.failed, again.succeeded, again.duplicates) == (0, 0, n)
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema, "spark-outcomes")) == 1
        assert tracker.status(c, b, schema=schema).late == 0


def test_an_item_named_twice_ends_the_same_whatever_the_partitioning(spark, pg_dsn, schema):
    """Failed beats succeeded, and among reasons the first in sort order wins, on any layout.

    One batch per layout, all recorded by one job: a union keeps each batch's rows spread over its
    own partitions (1, 3 or 7), and each partition is folded on its own, as in a job of its own."""
    layouts, parts = (1, 3, 7), []
    batches = [_batch(pg_dsn, schema, 50) for _ in layouts]
    for b, layout in zip(batches, layouts):
        rows = []
        for k in range(50):
            rows += [(f"{b}:0:{k}", "succeeded", None), (f"{b}:0:{k}", "failed", f"r{k % 4}")]
            rows += [(f"{b}:0:{k}", "failed", f"r{(k + 1) % 4}")] if k % 2 else []
        parts.append(spark.createDataFrame(rows, "item_id string, outcome string, reason string").repartition(layout))
    df = parts[0].union(parts[1]).union(parts[2])
    assert df.rdd.getNumPartitions() == sum(layouts)  # no shuffle: every batch kept its layout
    got = tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema)
    assert (got.failed, got.succeeded) == (50 * len(layouts), 0)
    ends = [[(i.rsplit(":", 1)[1], r) for i, r in _failures(pg_dsn, schema, b)] for b in batches]
    expected = [(str(k), f"r{min(k % 4, (k + 1) % 4) if k % 2 else k % 4}") for k in range(50)]
    assert ends == [expected] * len(layouts)


@pytest.mark.parametrize(
    ("row", "column", "shown"),
    [
        (("{b}:0:1", "faild", "x"), "outcome", "'faild'"),
        (("{b}:0:1", None, None), "outcome", "None"),
        (("{b}:0:1", "failed", None), "reason", "None"),
        (("{b}:0:1", "failed", ""), "reason", "''"),
        (("{b}:0:1", "failed", "x" * 501), "reason", "501"),
        (("{b}:0:1", "failed", "a\x00b"), "reason", "NUL"),
    ],
)
def test_a_bad_outcome_or_reason_is_a_typed_error_naming_it_and_records_nothing(
    spark, pg_dsn, schema, row, column, shown
):
    b = _batch(pg_dsn, schema, 5)
    rows = [(f"{b}:0:0", "failed", "fine"), (f"{b}:0:2", "succeeded", None), (row[0].format(b=b), *row[1:])]
    df = spark.createDataFrame(rows, "item_id string, outcome string, reason string")
    with pytest.raises(InvalidValue) as err:
        tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema)
    assert err.value.name == column and shown in str(err.value)
    with psycopg.connect(pg_dsn) as c:
        assert tracker.status(c, b, schema=schema).pending == 5
    with pytest.raises(ValueError, match="'why'"):
        tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema, reason_column="why")


@pytest.mark.parametrize(
    ("schema_text", "name", "column"),
    [
        ("item_id bigint, outcome string, reason string", "column", "item_id"),
        ("item_id string, outcome int, reason string", "outcome_column", "outcome"),
        ("item_id string, outcome string, reason binary", "reason_column", "reason"),
    ],
)
def test_a_column_of_a_type_it_cannot_read_is_named_before_any_job(spark, pg_dsn, schema, schema_text, name, column):
    df = spark.createDataFrame([], schema_text)
    with pytest.raises(InvalidValue) as err:
        tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema)
    assert err.value.name == name and f"{name} '{column}': is a " in str(err.value)


def test_the_first_reason_in_sort_order_wins_when_a_partition_holds_more_groups_than_a_round(spark, pg_dsn, schema):
    """A partition of more (group, reason) masks than one transaction takes (4,096) is recorded in
    several rounds: an item failed under two reasons still ends under the first in sort order."""
    groups = 4_200
    b = _batch(pg_dsn, schema, groups * 8192)
    rows = [(f"{b}:{g}:0", "failed", r) for g in range(groups) for r in ("b-second", "a-first")]
    df = spark.createDataFrame(rows, "item_id string, outcome string, reason string").repartition(3)
    got = tspark.outcome_dataframe(df, dsn=pg_dsn, schema=schema, partitions=1)
    assert (got.failed, got.duplicates, got.rejected) == (groups, groups, [])
    with psycopg.connect(pg_dsn) as c:
        reasons = c.execute(
            psycopg.sql.SQL("SELECT r.text, count(*) FROM {} f JOIN {} r ON r.id = f.reason_id GROUP BY 1").format(
                psycopg.sql.Identifier(schema, "group_failure"), psycopg.sql.Identifier(schema, "failure_reason")
            )
        ).fetchall()
    assert reasons == [("a-first", groups)]
