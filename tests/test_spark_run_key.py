"""fan_out's run key names a job: the same call made again (a job submitted again after a failure,
or after it finished) finds the batch and run of the first and writes every row once, also when
the job opens its own batch. A failed fan-out names its batch; a bad run key is refused before any
batch is opened."""

from __future__ import annotations

import threading

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tracker_support import invariant_violations

import tracker
from tracker import spark as tspark
from tracker.errors import InvalidArgument, InvalidValue
from tracker.spark.runs import job_batch

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def spark():
    session = tspark.local_session(
        "local[2,2]",  # a task may fail twice
        app_name="tracker-run-key-tests",
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    yield session
    session.stop()


def _rows(spark, n, partitions=4):
    return spark.range(0, n, numPartitions=partitions).selectExpr("CAST(concat('p-', id) AS BINARY) AS value")


def _state(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(f'SELECT count(*) FROM "{schema}".{table}').fetchone()[0]
            for table in ("batch", "batch_group", "outbox", "spark_fanout_run")
        ]


def _outbox(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            f'SELECT count(*), count(DISTINCT value), count(DISTINCT header_values[1]) FROM "{schema}".outbox '
            "WHERE topic = 'work'"
        ).fetchone()


def _failing_partition_1():
    def fail(partition, attempt):  # before its commit, on every attempt (a local function: pickled by value)
        if partition == 1:
            raise RuntimeError("injected: partition 1 keeps failing")

    return fail


def test_a_job_submitted_again_with_its_run_key_writes_each_row_once_into_one_batch(spark, pg_dsn, schema):
    n, kw = 4000, {"dsn": pg_dsn, "topic": "work", "schema": schema, "user_key": "catalog-42", "run_key": "c42-v1"}
    with pytest.raises(Exception, match="partition 1 keeps failing") as failed:
        tspark.fan_out(_rows(spark, n), **kw, before_commit=_failing_partition_1())
    # the failure names the batch the call opened and its run
    with psycopg.connect(pg_dsn) as c:
        (opened,) = c.execute(f'SELECT id FROM "{schema}".batch').fetchall()
    assert (failed.value.batch_id, failed.value.run) == (opened[0], 0)
    assert any(f"batch {opened[0]}, run 0" in note for note in failed.value.__notes__)
    assert _outbox(pg_dsn, schema)[0] <= n - 1000  # what the other partitions committed stays

    again = tspark.fan_out(_rows(spark, n), **kw)  # the same call: only what is missing is written
    assert (again.batch_id, again.run, again.items, again.groups) == (opened[0], 0, n, 4)
    assert _outbox(pg_dsn, schema) == (n, n, n)
    # A job that finished, submitted again (a scheduler's retry), writes nothing and says the same.
    before = _state(pg_dsn, schema)
    done = tspark.fan_out(_rows(spark, n), **kw, id_col="item_id")
    assert (done.batch_id, done.run, done.items, done.complete) == (opened[0], 0, n, False)
    assert _state(pg_dsn, schema) == before
    with psycopg.connect(pg_dsn) as c:
        written = {bytes(r[0]).decode() for r in c.execute(f'SELECT header_values[1] FROM "{schema}".outbox')}
        st_ = tracker.status(c, opened[0], schema=schema)
        assert (st_.state, st_.total, st_.pending) == ("closed", n, n)
        assert invariant_violations(c, schema) == []
    assert {r.item_id for r in done.dataframe.select("item_id").collect()} == written


def test_a_failed_fan_out_without_a_run_key_names_the_batch_it_opened(spark, pg_dsn, schema):
    with pytest.raises(Exception, match="partition 1 keeps failing") as failed:
        tspark.fan_out(_rows(spark, 400), dsn=pg_dsn, topic="work", schema=schema, before_commit=_failing_partition_1())
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT id, state FROM "{schema}".batch').fetchall() == [(failed.value.batch_id, "open")]


def test_a_run_key_names_one_job_its_user_key_and_completion_topic_cannot_change(spark, pg_dsn, schema):
    first = tspark.fan_out(_rows(spark, 10), dsn=pg_dsn, topic="work", schema=schema, user_key="a", run_key="K")
    before = _state(pg_dsn, schema)
    for other in ({"user_key": "b"}, {"user_key": "a", "completion_topic": "elsewhere"}):
        with pytest.raises(InvalidValue, match=f"names the fan-out job of batch {first.batch_id}") as info:
            tspark.fan_out(_rows(spark, 10), dsn=pg_dsn, topic="work", schema=schema, run_key="K", **other)
        assert info.value.name == "run_key"
    assert _state(pg_dsn, schema) == before
    # the key of a job is not the key of a run in a batch of the caller's: that one is per batch
    with psycopg.connect(pg_dsn) as c:
        mine = tracker.open_batch(c, schema=schema)
        c.commit()
    inside = tspark.fan_out(_rows(spark, 10), dsn=pg_dsn, topic="work", schema=schema, batch=mine, run_key="K")
    assert (inside.batch_id, inside.run, inside.items) == (mine.id, 0, 10)


def test_submissions_of_one_run_key_at_once_open_one_batch(pg_dsn, schema):
    found, errors, start = [], [], threading.Barrier(6)

    def submit():
        try:
            with psycopg.connect(pg_dsn) as conn:
                start.wait()
                found.append(job_batch(conn, "at-once", schema=schema, user_key="u"))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=submit) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(found) == 6 and len(set(found)) == 1
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT id FROM "{schema}".batch').fetchall() == [(found[0],)]


BAD_RUN_KEYS = st.one_of(
    st.integers(),
    st.binary(max_size=5),
    st.lists(st.text(max_size=2), max_size=2),
    st.just(""),
    st.text(max_size=5).map(lambda s: s + "\x00"),
    st.text(min_size=1, max_size=3).map(lambda s: s + "\ud800"),  # a lone surrogate: not UTF-8
    st.integers(min_value=1001, max_value=1100).map(lambda k: "k" * k),
    st.integers(min_value=501, max_value=900).map(lambda k: "é" * 2 + "\U0001f600" * k),  # > 2,000 bytes
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(run_key=BAD_RUN_KEYS, given_batch=st.booleans())
def test_a_bad_run_key_is_refused_before_any_batch_is_opened_or_run_begun(spark, pg_dsn, schema, run_key, given_batch):
    batch = None
    if given_batch:
        with psycopg.connect(pg_dsn) as c:
            batch = tracker.open_batch(c, schema=schema)
            c.commit()
    before = _state(pg_dsn, schema)
    with pytest.raises((InvalidArgument, InvalidValue)) as info:
        tspark.fan_out(_rows(spark, 3, 1), dsn=pg_dsn, topic="work", schema=schema, batch=batch, run_key=run_key)
    assert info.value.name == "run_key" and info.value.value is run_key
    assert _state(pg_dsn, schema) == before


def test_job_batch_needs_a_run_key(pg_dsn, schema):
    before = _state(pg_dsn, schema)
    with psycopg.connect(pg_dsn) as conn, pytest.raises(InvalidArgument) as info:
        job_batch(conn, None, schema=schema)  # type: ignore[arg-type]
    assert info.value.name == "run_key" and info.value.value is None
    assert _state(pg_dsn, schema) == before


def test_a_race_lost_under_repeatable_read_finds_the_winners_batch(pg_dsn, schema):
    """Under REPEATABLE READ the lost claim is a serialization failure: a new transaction sees the
    winner's batch, as under READ COMMITTED."""
    with psycopg.connect(pg_dsn) as winner, psycopg.connect(pg_dsn) as loser:
        loser.execute("SET default_transaction_isolation = 'repeatable read'")
        loser.commit()
        won = tracker.open_batch(winner, user_key="u", schema=schema)
        winner.execute(
            f'INSERT INTO "{schema}".spark_fanout_run (batch_id, run, run_key, opened_batch) VALUES (%s, 0, %s, true)',
            [won.id, "rr-race"],
        )  # not committed yet: the loser's claim waits for it
        found, errors = [], []

        def submit():
            try:
                found.append(job_batch(loser, "rr-race", schema=schema, user_key="u"))
            except Exception as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        thread = threading.Thread(target=submit)
        thread.start()
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            for _ in range(600):  # until the loser's claim waits on the winner's row
                waiting = watch.execute(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", [loser.info.backend_pid]
                ).fetchone()
                if waiting and waiting[0]:
                    break
                thread.join(0.05)
        winner.commit()
        thread.join(60)
    assert errors == [] and found == [won.id]
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT id FROM "{schema}".batch').fetchall() == [(won.id,)]
