"""Every path that completes a batch writes the same completion event: one row on the batch's
completion topic, key = batch id, JSON value {batch_id, user_key, total, opened_at, closed_at,
completed_at} (in that order, the batch's own values), headers `batch-id` and, when the batch was
opened under a span, `traceparent` and `tracestate`. The paths: a close (Python, SQL function,
HTTP on both backends), a bulk ack (Python, SQL `ack`, SQL `ack_masks`, HTTP on both backends),
the acker's masks (`apply_masks`), claims settled at their commit, by `tracker.settle` and by a
close that folds them. The event is built once, by the schema's completion_event; this test is
what keeps every path on it."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable

import httpx
import psycopg
import pytest
from psycopg import sql
from support.http_server import TOKEN, RunningServer, http_config

import tracker
from tracker.expiry import EXPIRY_EVENT, expire_batch
from tracker.ids import fold

TOPIC = "events-done"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACESTATE = "vendor=abc,other=1"
ITEMS = 2


def _open(conn: psycopg.Connection, t: tracker.Tracker, traced: bool) -> tuple[int, list[str]]:
    """An open batch of ITEMS items, with the opening span's context stored as open_batch stores it."""
    b = t.open_batch(conn, user_key="uk-1", completion_topic=TOPIC)
    [g] = t.add_items(conn, b, ITEMS)
    if traced:
        conn.execute(
            sql.SQL("UPDATE {} SET traceparent = %s, tracestate = %s WHERE id = %s").format(
                sql.Identifier(t.config.schema, "batch")
            ),
            [TRACEPARENT, TRACESTATE, b.id],
        )
    return b.id, g.item_ids


def _call(conn: psycopg.Connection, schema: str, function: str, *args: object) -> None:
    conn.execute(
        sql.SQL("SELECT * FROM {}({})").format(
            sql.Identifier(schema, function), sql.SQL(", ").join(sql.Placeholder() * len(args))
        ),
        list(args),
    )


def _hold_batch_row(pg_dsn: str, schema: str, b: int) -> psycopg.Connection:
    """Another transaction holding the batch row: a commit-time settle skips the batch."""
    holder = psycopg.connect(pg_dsn)
    holder.execute(
        sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR NO KEY UPDATE").format(sql.Identifier(schema, "batch")), [b]
    )
    return holder


def _committed_claims(pg_dsn: str, schema: str, t: tracker.Tracker, conn: psycopg.Connection, b: int, ids: list[str]):
    holder = _hold_batch_row(pg_dsn, schema, b)
    try:
        t.ack(conn, ids)  # claims: settled at commit only if the batch row is free, and it is not
        conn.commit()
    finally:
        holder.rollback()
        holder.close()


def python_close(ctx) -> None:
    ctx.t.ack(ctx.conn, ctx.ids, claims=False)
    ctx.t.close_batch(ctx.conn, ctx.b)


def python_bulk_ack(ctx) -> None:
    ctx.t.close_batch(ctx.conn, ctx.b)
    ctx.t.ack(ctx.conn, ctx.ids, claims=False)


def acker_masks(ctx) -> None:
    ctx.t.close_batch(ctx.conn, ctx.b)
    ctx.t.apply_masks(ctx.conn, fold(ctx.ids))


def claims_settled_at_commit(ctx) -> None:
    ctx.t.close_batch(ctx.conn, ctx.b)
    ctx.conn.commit()
    ctx.t.ack(ctx.conn, ctx.ids)


def claims_settled_by_settle(ctx) -> None:
    ctx.t.close_batch(ctx.conn, ctx.b)
    ctx.conn.commit()
    _committed_claims(ctx.pg_dsn, ctx.schema, ctx.t, ctx.conn, ctx.b, ctx.ids)
    assert tracker.settle(ctx.conn, [ctx.b], schema=ctx.schema).completed == [ctx.b]


def claims_settled_by_close(ctx) -> None:
    ctx.conn.commit()
    _committed_claims(ctx.pg_dsn, ctx.schema, ctx.t, ctx.conn, ctx.b, ctx.ids)
    assert ctx.t.close_batch(ctx.conn, ctx.b) is True


def sql_close_batch(ctx) -> None:
    _call(ctx.conn, ctx.schema, "ack", ctx.ids)
    _call(ctx.conn, ctx.schema, "close_batch", ctx.b)


def sql_ack(ctx) -> None:
    _call(ctx.conn, ctx.schema, "close_batch", ctx.b)
    _call(ctx.conn, ctx.schema, "ack", ctx.ids)


def sql_ack_masks(ctx) -> None:
    _call(ctx.conn, ctx.schema, "close_batch", ctx.b)
    masks = fold(ctx.ids)
    _call(
        ctx.conn,
        ctx.schema,
        "ack_masks",
        [b for b, _ in masks],
        [g for _, g in masks],
        [bytes(m.bits).hex() for m in masks.values()],
    )


def _http(backend: str, close_last: bool) -> Callable:
    def path(ctx) -> None:
        ctx.conn.commit()
        with RunningServer(http_config(ctx.pg_dsn, ctx.schema, backend=backend), [TOKEN]) as s:
            with httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
                if not close_last:
                    assert c.post(f"/v1/batches/{ctx.b}/close").status_code == 200
                r = c.post("/v1/acks", json={"ids": ctx.ids})
                assert r.status_code == 200, r.text
                if close_last:
                    assert c.post(f"/v1/batches/{ctx.b}/close").json()["complete"] is True
                else:
                    assert r.json()["completed"] == [ctx.b]

    path.__name__ = f"http_{backend}_{'close' if close_last else 'ack'}"
    return path


PATHS = [
    python_close,
    python_bulk_ack,
    acker_masks,
    claims_settled_at_commit,
    claims_settled_by_settle,
    claims_settled_by_close,
    sql_close_batch,
    sql_ack,
    sql_ack_masks,
    _http("tracker", close_last=True),
    _http("tracker", close_last=False),
    _http("sql", close_last=True),
    _http("sql", close_last=False),
]


class Ctx:
    def __init__(self, **kw: object) -> None:
        self.__dict__.update(kw)


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "untraced"])
@pytest.mark.parametrize("path", PATHS, ids=[p.__name__ for p in PATHS])
def test_every_completion_path_writes_the_same_event(pg_dsn, schema, path, traced):
    t = tracker.Tracker(schema=schema)
    with psycopg.connect(pg_dsn) as conn:
        b, ids = _open(conn, t, traced)
        path(Ctx(conn=conn, t=t, b=b, ids=ids, schema=schema, pg_dsn=pg_dsn))
        conn.commit()
        rows = conn.execute(
            sql.SQL(
                "SELECT topic, convert_from(key, 'UTF8'), value, header_keys, header_values FROM {} "
                "WHERE key = convert_to(%s, 'UTF8') ORDER BY id"
            ).format(sql.Identifier(schema, "outbox")),
            [str(b)],
        ).fetchall()
        batch = conn.execute(
            sql.SQL("SELECT state, created_at, closed_at, completed_at FROM {} WHERE id = %s").format(
                sql.Identifier(schema, "batch")
            ),
            [b],
        ).fetchone()
    assert batch is not None and batch[0] == "complete"
    assert len(rows) == 1, rows  # exactly one completion event
    topic, key, value, header_keys, header_values = rows[0]
    assert (topic, key) == (TOPIC, str(b))
    headers = list(zip(header_keys, [bytes(v).decode() for v in header_values]))
    expected = [("batch-id", str(b))] + ([("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)] if traced else [])
    assert headers == expected
    event = json.loads(bytes(value))
    # schema version 2: the version 1 keys first, unchanged, then the outcome and its summary
    assert list(event) == [
        *("batch_id", "user_key", "total", "opened_at", "closed_at", "completed_at"),
        *("event", "schema_version", "outcome", "succeeded", "failed", "pending", "parent_id", "children", "rollup"),
    ]
    assert (event["event"], event["schema_version"], event["outcome"]) == ("batch.completed", 2, "succeeded")
    assert (event["succeeded"], event["failed"], event["pending"], event["parent_id"]) == (ITEMS, 0, 0, None)
    assert event["children"] == {"total": 0, "failed": 0}
    assert event["rollup"] == {"total": ITEMS, "succeeded": ITEMS, "failed": 0}
    assert (event["batch_id"], event["user_key"], event["total"]) == (b, "uk-1", ITEMS)
    stamps = [dt.datetime.fromisoformat(event[k]) for k in ("opened_at", "closed_at", "completed_at")]
    assert stamps == list(batch[1:])


# The events as the callers insert them (tracker.core.batches.completion_insert, tracker.expiry,
# close_batch, ack_masks, ack_settle): from FROM, one event per batch row.
EVENT_CALLS = {
    "completion_event": "{event}(b, 'default-topic')",
    "expiry_event": "{event}(b, 'expiry-topic', 'idle', '{{\"note\": \"n\"}}'::jsonb)",
}


@pytest.mark.parametrize("function", sorted(EVENT_CALLS))
def test_the_events_are_inlined_into_the_statement_that_inserts_them(conn, schema, function):
    """No function call per event: the plan holds the event's own expressions, not a scan of the
    function (a SET clause, SECURITY DEFINER, STRICT, VOLATILE or a non-SETOF result would undo it)."""
    conn.execute("SET search_path TO public")  # as an application calls them: qualified, from anywhere
    call = sql.SQL(EVENT_CALLS[function]).format(event=sql.Identifier(schema, function))
    plan = "\n".join(
        line
        for (line,) in conn.execute(
            sql.SQL(
                "EXPLAIN (VERBOSE, COSTS OFF) INSERT INTO {} (topic, key, value, header_keys, header_values) "
                "SELECT e.* FROM {} b CROSS JOIN LATERAL {} e"
            ).format(sql.Identifier(schema, "outbox"), sql.Identifier(schema, "batch"), call)
        ).fetchall()
    )
    assert "Function Scan" not in plan and "_event" not in plan, plan
    assert "convert_to" in plan and "batch-id" in plan, plan  # batch_event's body, inlined in turn


def test_the_events_ignore_the_callers_search_path(pg_dsn, schema):
    """Inlined, the events still resolve their names where migrate created them: a caller whose
    search_path puts its own batch_event and convert_to before pg_catalog gets the same events."""
    decoy = f"d_{uuid.uuid4().hex[:10]}"
    t = tracker.Tracker(schema=schema)
    with psycopg.connect(pg_dsn) as conn:
        b, ids = _open(conn, t, traced=True)
        expiring = t.open_batch(conn, user_key="uk-2")
        conn.commit()
        d, batch = sql.Identifier(decoy), sql.Identifier(schema, "batch")
        try:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(d))
            conn.execute(
                sql.SQL(
                    "CREATE FUNCTION {}.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$ SELECT 'decoy'::bytea $$"
                ).format(d)
            )
            conn.execute(
                sql.SQL(
                    "CREATE FUNCTION {}.batch_event(b {}, to_topic text, body text, event_keys text[],"
                    " event_values bytea[], OUT topic text, OUT key bytea, OUT value bytea, OUT header_keys text[],"
                    " OUT header_values bytea[]) RETURNS SETOF record LANGUAGE sql"
                    " AS $$ SELECT 'decoy', 'decoy'::bytea, 'decoy'::bytea, '{{}}'::text[], '{{}}'::bytea[] $$"
                ).format(d, batch)
            )
            conn.execute(sql.SQL("SET search_path TO {}, pg_catalog").format(d))
            t.close_batch(conn, b)
            t.ack(conn, ids, claims=False)  # completes the batch: a bulk ack's completion_insert
            assert expire_batch(conn, expiring.id, schema=schema) is not None
            rows = conn.execute(
                sql.SQL(
                    "SELECT topic, pg_catalog.convert_from(key, 'UTF8'), header_keys,"
                    " (SELECT array_agg(pg_catalog.convert_from(v, 'UTF8')) FROM unnest(header_values) v)"
                    " FROM {} ORDER BY id"
                ).format(sql.Identifier(schema, "outbox"))
            ).fetchall()
        finally:
            conn.rollback()
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(d))
            conn.commit()
    assert rows == [
        (TOPIC, str(b), ["batch-id", "traceparent", "tracestate"], [str(b), TRACEPARENT, TRACESTATE]),
        ("batch-completions", str(expiring.id), ["batch-id", "event"], [str(expiring.id), EXPIRY_EVENT]),
    ]
