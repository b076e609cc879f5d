"""The SQL functions of sql/R__sql_api.sql and the Python API agree: hypothesis runs the same
operations through both, on twin schemas, and compares results, errors (class and the id they
name) and the state they leave behind."""

from __future__ import annotations

import json
import os
import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from support.teardown import drop_schema

import tracker
from tracker import outbox
from tracker.errors import SQLSTATES, TrackerError

# the Python error class -> the SQLSTATE the SQL functions raise for the same mistake
SQLSTATE = {cls: code for code, (_, classes) in SQLSTATES.items() for cls in classes}


def _python_op(conn: psycopg.Connection, schema: str, op: tuple) -> object:
    kind = op[0]
    if kind == "open":
        return tracker.open_batch(conn, user_key=op[1], schema=schema).id
    if kind == "add":
        return [(h.batch_id, h.group_id, h.start, h.upto) for h in tracker.add_items(conn, op[1], op[2], schema=schema)]
    if kind == "enqueue":
        return [
            (h.batch_id, h.group_id, h.start, h.upto)
            for h in outbox.enqueue(conn, op[1], [f"v{i}".encode() for i in range(op[2])], topic="t", schema=schema)
        ]
    if kind == "close":
        return tracker.close_batch(conn, op[1], schema=schema)
    if kind == "ack":
        # the SQL ack() decides as tracker.ack does: claims up to 1,000 items (settled at commit,
        # `completed` empty), the masked path beyond (the caller's batch locks, completion reported)
        r = tracker.ack(conn, list(op[1]), schema=schema)
        return (r.acked, r.duplicates, sorted(r.completed))
    if kind == "status":
        s = tracker.status(conn, op[1], schema=schema)
        return (s.state, s.total, s.pending, s.user_key)
    raise AssertionError(kind)


def _sql_op(conn: psycopg.Connection, schema: str, op: tuple) -> object:
    s, kind = sql.Identifier(schema), op[0]
    if kind == "open":
        return conn.execute(sql.SQL("SELECT {}.open_batch(%s)").format(s), [op[1]]).fetchone()[0]
    if kind == "add":
        return conn.execute(sql.SQL("SELECT * FROM {}.add_items(%s, %s)").format(s), [op[1], op[2]]).fetchall()
    if kind == "enqueue":
        return conn.execute(
            sql.SQL("SELECT * FROM {}.enqueue(%s, 't', %s)").format(s),
            [op[1], [f"v{i}".encode() for i in range(op[2])]],
        ).fetchall()
    if kind == "close":
        return conn.execute(sql.SQL("SELECT {}.close_batch(%s)").format(s), [op[1]]).fetchone()[0]
    if kind == "ack":
        acked, dups, completed = conn.execute(
            sql.SQL("SELECT * FROM {}.ack(%s::text[])").format(s), [list(op[1])]
        ).fetchone()
        return (acked, dups, sorted(completed))
    if kind == "status":
        return conn.execute(
            sql.SQL("SELECT state, total, pending, user_key FROM {}.batch_status(%s)").format(s), [op[1]]
        ).fetchone()
    raise AssertionError(kind)


def _outcome(fn, conn: psycopg.Connection, schema: str, op: tuple) -> tuple:
    try:
        with conn.transaction():  # a savepoint: a failed op leaves the example's transaction usable
            return ("ok", fn(conn, schema, op))
    except TrackerError as exc:
        named = getattr(exc, "item_id", None) or str(getattr(exc, "batch_id", ""))
        return ("error", SQLSTATE[type(exc)], named)
    except psycopg.Error as exc:
        if exc.sqlstate and exc.sqlstate.startswith("RT"):
            return ("error", exc.sqlstate, exc.diag.message_detail)
        raise


def _state(conn: psycopg.Connection, schema: str) -> tuple:
    q = lambda t, cols, order: conn.execute(
        sql.SQL("SELECT " + cols + " FROM {} ORDER BY " + order).format(  # noqa: E731
            sql.Identifier(schema, t)
        )
    ).fetchall()
    events = [
        (
            t,
            k,
            {n: v for n, v in json.loads(value).items() if not n.endswith("_at")} if hk == ["batch-id"] else value,
            hk,
            hv,
        )
        for t, k, value, hk, hv in q("outbox", "topic, key, value, header_keys, header_values", "id")
    ]
    return (
        q("batch", "id, user_key, state, total, pending, next_group, closed_at IS NULL, completed_at IS NULL", "id"),
        q("batch_group", "batch_id, id, size, pending, bits::text", "batch_id, id"),
        events,
    )  # completion events without their timestamps


_ids = st.one_of(
    st.builds(
        lambda b, g, i: f"{b}:{g}:{i}",
        st.integers(1, 3),
        st.integers(0, 2),
        st.one_of(st.integers(0, 40), st.integers(8180, 8195)),
    ),
    st.builds(
        lambda b, g, i, n: f"{b}:{g}:{i}-{i + n}",
        st.integers(1, 3),
        st.integers(0, 2),
        st.integers(0, 8191),
        st.integers(-2, 300),
    ),
    st.sampled_from(
        [
            "x",
            "1:0",
            "1:0:",
            "1::0",
            "1:0:0-",
            "01:0:007",
            "1:0:00000",
            "1:0:99999",
            "99999999999999999999:0:1",
            "1:0:1-2-3",
            "1:0:+1",
            "1:0:1 ",
            "²:0:1",
        ]
    ),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 3), st.one_of(st.integers(0, 40), st.integers(8150, 17000))),
        st.tuples(st.just("enqueue"), st.integers(1, 3), st.integers(0, 30)),
        st.tuples(st.just("close"), st.integers(1, 3)),
        st.tuples(st.just("ack"), st.lists(_ids, min_size=0, max_size=8)),
        st.tuples(st.just("expire"), st.integers(1, 3)),
        st.tuples(st.just("status"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=12,
)


@pytest.fixture
def twin_schemas(pg_dsn):
    """Two migrated schemas: one driven through the Python API, one through the SQL functions."""
    names = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    for name in names:
        tracker.schema.migrate(pg_dsn, name)
    yield names
    for name in names:
        drop_schema(pg_dsn, name)


@settings(
    max_examples=int(os.environ.get("SQL_FUNCTIONS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=_ops,
    keys=st.lists(st.one_of(st.none(), st.text(max_size=5).filter(lambda t: "\x00" not in t)), min_size=2, max_size=2),
)
def test_sql_functions_agree_with_the_python_api(pg_dsn, twin_schemas, ops, keys):
    py_schema, sql_schema = twin_schemas
    with psycopg.connect(pg_dsn) as py_conn, psycopg.connect(pg_dsn) as sql_conn:
        try:
            # Batches 1 and 2 exist (ids restart per example: the schemas are reset below); 3 never does.
            for fn, conn, schema in ((_python_op, py_conn, py_schema), (_sql_op, sql_conn, sql_schema)):
                conn.execute(
                    sql.SQL("TRUNCATE {}, {}, {} RESTART IDENTITY CASCADE").format(
                        sql.Identifier(schema, "batch"),
                        sql.Identifier(schema, "batch_group"),
                        sql.Identifier(schema, "outbox"),
                    )
                )
                assert [fn(conn, schema, ("open", k)) for k in keys] == [1, 2]
            for op in ops:
                if op[0] == "expire":
                    for conn, schema in ((py_conn, py_schema), (sql_conn, sql_schema)):
                        conn.execute(
                            sql.SQL(
                                "UPDATE {} SET state = 'expired', expired_at = now() "
                                "WHERE id = %s AND state IN ('open', 'closed')"
                            ).format(sql.Identifier(schema, "batch")),
                            [op[1]],
                        )
                    continue
                got_py = _outcome(_python_op, py_conn, py_schema, op)
                got_sql = _outcome(_sql_op, sql_conn, sql_schema, op)
                if got_py[0] == "ok" and op[0] == "status":
                    got_py = ("ok", tuple(got_py[1]))
                assert got_sql == got_py, op
            assert _state(sql_conn, sql_schema) == _state(py_conn, py_schema)
        finally:
            py_conn.rollback()
            sql_conn.rollback()
