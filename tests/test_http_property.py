"""Hypothesis: the HTTP API and the Python API agree, call for call, on results, on errors (the
problem type against the exception class, and the id or batch each names) and on the state left:
acks, failures and their pages, adds, closes and statuses with their outcomes and counts."""

from __future__ import annotations

import os
import uuid

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from support.http_server import TOKEN, RunningServer, http_config
from support.teardown import drop_schema

import tracker
from tracker.errors import (
    BatchExpired,
    BatchNotOpen,
    IndexOutOfRange,
    MalformedItemId,
    TrackerError,
    UnknownBatch,
    UnknownGroup,
)

SLUG = {
    MalformedItemId: "malformed-item-id",
    IndexOutOfRange: "index-out-of-range",
    UnknownGroup: "unknown-group",
    BatchNotOpen: "batch-not-open",
    BatchExpired: "batch-expired",
}


@pytest.fixture
def twins(pg_dsn):
    names = [f"t_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    for name in names:
        tracker.schema.migrate(pg_dsn, name)
    with (
        RunningServer(http_config(pg_dsn, names[0], rate_limit=0), [TOKEN]) as s,
        httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c,
    ):
        yield c, names
    for name in names:
        drop_schema(pg_dsn, name)


def _http(c: httpx.Client, op: tuple) -> tuple:
    kind = op[0]
    if kind == "add":
        r = c.post(f"/v1/batches/{op[1]}/items", json={"count": op[2]})
    elif kind == "close":
        r = c.post(f"/v1/batches/{op[1]}/close")
    elif kind == "ack":
        r = c.post("/v1/acks", json={"ids": list(op[1])})
    elif kind == "fail":
        r = c.post("/v1/failures", json={"ids": list(op[1]), "reason": op[2]})
    elif kind == "failures":
        r = c.get(f"/v1/batches/{op[1]}/failures", params={"limit": op[3], **({"after": op[2]} if op[2] else {})})
    else:
        r = c.get(f"/v1/batches/{op[1]}")
    if r.status_code >= 400:
        doc = r.json()
        slug = doc["type"].rsplit(":", 1)[1]
        slug = "unknown-batch" if slug == "unknown-batch-in-body" else slug
        return ("error", slug, doc.get("item_id") or str(doc.get("batch_id", "")))
    body = r.json()
    if kind == "add":
        return ("ok", [(g["group_id"], g["start"], g["upto"]) for g in body["groups"]])
    if kind == "close":
        return ("ok", body["complete"])
    if kind == "ack":
        return ("ok", (body["acked"], body["duplicates"], sorted(body["completed"])))
    if kind == "fail":
        return ("ok", (body["failed"], body["duplicates"], sorted(body["completed"])))
    if kind == "failures":
        return ("ok", ([(f["item_id"], f["reason"]) for f in body["failures"]], body["next"]))
    return ("ok", (body["state"], body["total"], body["pending"], body["outcome"], body["failed"], body["late"]))


def _python(conn: psycopg.Connection, t: tracker.Tracker, op: tuple) -> tuple:
    kind = op[0]
    try:
        if kind == "add":
            return ("ok", [(h.group_id, h.start, h.upto) for h in t.add_items(conn, op[1], op[2])])
        if kind == "close":
            return ("ok", t.close_batch(conn, op[1]))
        if kind == "ack":
            r = t.ack(conn, list(op[1]), claims=False)  # the server acks on the masked path
            return ("ok", (r.acked, r.duplicates, sorted(r.completed)))
        if kind == "fail":
            f = t.fail(conn, list(op[1]), op[2])
            return ("ok", (f.failed, f.duplicates, sorted(f.completed)))
        if kind == "failures":
            page = t.failures(conn, op[1], after=op[2], limit=op[3])
            return ("ok", ([tuple(i) for i in page.items], page.next))
        s = t.status(conn, op[1])
        return ("ok", (s.state, s.total, s.pending, s.outcome, s.failed, s.late))
    except UnknownBatch as exc:
        return ("error", "unknown-batch", exc.item_id or str(exc.batch_id))
    except TrackerError as exc:
        return ("error", SLUG[type(exc)], getattr(exc, "item_id", None) or str(getattr(exc, "batch_id", "")))


_ids = st.one_of(
    st.builds(
        lambda b, g, i: f"{b}:{g}:{i}",
        st.integers(1, 3),
        st.integers(0, 2),
        st.one_of(st.integers(0, 30), st.integers(8185, 8193)),
    ),
    st.builds(
        lambda b, g, i, n: f"{b}:{g}:{i}-{i + n}",
        st.integers(1, 3),
        st.integers(0, 2),
        st.integers(0, 8191),
        st.integers(-1, 200),
    ),
    st.sampled_from(["x", "1:0", "1:0:1-", "1:0:0007", "1:0:99999", "1:a:1"]),
)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 3), st.one_of(st.integers(0, 30), st.integers(8180, 9000))),
        st.tuples(st.just("close"), st.integers(1, 3)),
        st.tuples(st.just("ack"), st.lists(_ids, min_size=1, max_size=6)),
        st.tuples(st.just("fail"), st.lists(_ids, min_size=1, max_size=6), st.sampled_from(["timeout", "bad row"])),
        st.tuples(
            st.just("failures"),
            st.integers(1, 3),
            st.one_of(st.none(), st.builds(lambda g, i: f"{{b}}:{g}:{i}", st.integers(0, 2), st.integers(0, 30))),
            st.integers(1, 3),
        ),
        st.tuples(st.just("status"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=10,
)


@settings(
    max_examples=int(os.environ.get("HTTP_PROPERTY_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=_ops)
def test_http_agrees_with_the_python_api(pg_dsn, twins, ops):
    client, (http_schema, py_schema) = twins
    t = tracker.Tracker(schema=py_schema)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in (http_schema, py_schema):
            conn.execute(
                sql.SQL("TRUNCATE {}, {}, {} RESTART IDENTITY CASCADE").format(
                    sql.Identifier(name, "batch"), sql.Identifier(name, "batch_group"), sql.Identifier(name, "outbox")
                )
            )
        # batches 1 and 2 exist in both (2 tolerates one failed item); 3 in neither
        assert client.post("/v1/batches", json={}).json()["batch_id"] == 1
        assert client.post("/v1/batches", json={"tolerated_failures": 1}).json()["batch_id"] == 2
        assert [t.open_batch(conn).id, t.open_batch(conn, tolerated_failures=1).id] == [1, 2]
        for op in ops:
            if op[0] == "failures" and op[2] is not None:  # a cursor of the batch read
                op = (op[0], op[1], op[2].format(b=op[1]), op[3])
            assert _http(client, op) == _python(conn, t, op), op
        state = "SELECT id, state, total, pending, next_group, failed, late, outcome FROM {} ORDER BY id"
        groups = "SELECT batch_id, id, size, pending, bits::text FROM {} ORDER BY batch_id, id"
        for q, table in ((state, "batch"), (groups, "batch_group")):
            rows = [
                conn.execute(sql.SQL(q).format(sql.Identifier(name, table))).fetchall()
                for name in (http_schema, py_schema)
            ]
            assert rows[0] == rows[1]
