"""tracker.spark logged in as the `app` role (what the Python API runs as), never as the owner: a
fan-out takes its run and writes its partitions, and acks of a DataFrame finish the batch."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from support.teardown import drop_role
from test_roles import granted  # noqa: F401 (fixture)
from test_tracker_support import invariant_violations

import tracker
from tracker import roles
from tracker import spark as tspark

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def spark():
    session = tspark.local_session(
        "local[2,2]",
        app_name="tracker-role-tests",
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"},
    )
    yield session
    session.stop()


@contextlib.contextmanager
def app_login(pg_dsn: str, schema: str) -> Iterator[str]:
    """The DSN of a login role that is a member of the schema's app role alone (the executors
    connect with it too)."""
    name = f"login_app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(name), sql.Identifier(roles.role_name(schema, "app"))
            )
        )
    try:
        yield pg_dsn.replace("postgres@", f"{name}@")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            drop_role(admin, name)


def test_a_fan_out_and_its_acks_run_as_the_app_role(spark, pg_dsn, granted):  # noqa: F811
    s, n = granted, 5000
    df = spark.range(0, n, numPartitions=3).selectExpr("CAST(concat('v-', id) AS STRING) AS value")
    with app_login(pg_dsn, s) as dsn:
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT current_user").fetchone()[0].startswith("login_app_")
        result = tspark.fan_out(df, dsn=dsn, topic="work", schema=s, user_key="as-app", id_col="item_id")
        assert (result.run, result.items) == (0, n)
        acked = tspark.ack_dataframe(result.dataframe.select("item_id"), dsn=dsn, schema=s)
        assert (acked.acked, acked.completed, acked.rejected) == (n, [result.batch_id], [])
    with psycopg.connect(pg_dsn) as c:
        assert tracker.status(c, result.batch_id, schema=s).state == "complete"
        assert invariant_violations(c, s) == []
