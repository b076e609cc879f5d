"""The SQL functions check their completion topic when the call starts, and resolve names only in
their schema, pg_catalog and pg_temp (from a plain psycopg client, as any other language calls them)."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

import tracker

LONG = "t" * 250  # Kafka's limit is 249


def _state(conn, schema):
    return (
        conn.execute(
            sql.SQL("SELECT id, state, pending FROM {} ORDER BY id").format(sql.Identifier(schema, "batch"))
        ).fetchall(),
        conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "outbox"))).fetchone(),
    )


@pytest.mark.parametrize(
    "call, args",
    [
        ("open_batch(%s, %s)", ["k", ""]),
        ("open_batch(%s, %s)", ["k", LONG]),
        ("close_batch(%s, %s)", ["{batch}", None]),
        ("close_batch(%s, %s)", ["{batch}", ""]),
        ("close_batch(%s, %s)", ["{batch}", LONG]),
        ("ack(%s, %s)", [["{item}"], None]),
        ("ack(%s, %s)", [["{item}"], LONG]),
        ("ack_masks(%s, %s, %s, %s)", [["{batch}"], [0], ["80"], ""]),
        ("open_batch(%s, %s)", ["k", "a b"]),
        ("open_batch(%s, %s)", ["k", ".."]),
        ("close_batch(%s, %s)", ["{batch}", "done/x"]),
        ("ack(%s, %s)", [["{item}"], "ü"]),
    ],
)
def test_a_bad_completion_topic_is_refused_up_front_even_on_the_completing_call(conn, schema, call, args):
    batch = tracker.open_batch(conn, schema=schema)
    (handle,) = tracker.add_items(conn, batch, 1, schema=schema)
    if not call.startswith("close"):
        tracker.close_batch(conn, batch, schema=schema)  # the ack would complete it
    conn.commit()
    fill = {"{batch}": batch.id, "{item}": handle.item_ids[0]}
    args = [[fill.get(a, a) for a in x] if isinstance(x, list) else fill.get(x, x) for x in args]
    before = _state(conn, schema)
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(sql.SQL("SELECT * FROM {}." + call).format(sql.Identifier(schema)), args)
    assert raised.value.sqlstate == "RT007"
    assert "completion_topic" in raised.value.diag.message_primary
    assert "INSERT" not in str(raised.value) and "violates" not in str(raised.value)
    conn.rollback()
    assert _state(conn, schema) == before


def test_open_batch_still_takes_null_for_the_default_topic(conn, schema):
    (batch_id,) = conn.execute(sql.SQL("SELECT {}.open_batch('k', NULL)").format(sql.Identifier(schema))).fetchone()
    assert batch_id >= 1


def test_every_function_resolves_names_in_its_schema_pg_catalog_and_pg_temp_only(conn, schema):
    """Each function pins that search_path, or is one of the events (sql/R__events.sql): plain SQL
    functions the planner inlines, which a SET clause would prevent, whose SQL-standard bodies bound
    their names when migrate created them under that path (tests/test_completion_event.py calls them
    under a hostile search_path)."""
    rows = conn.execute(
        "SELECT p.proname, p.proconfig, p.prosqlbody IS NOT NULL AND l.lanname = 'sql' AND NOT p.prosecdef"
        " FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.pronamespace = %s::regnamespace",
        [schema],
    ).fetchall()
    assert len(rows) >= 10
    bound = sorted(name for name, config, atomic in rows if atomic and config is None)
    assert bound == ["batch_event", "completion_event", "expiry_event"]
    for name, config, _ in rows:
        if name in bound:
            continue
        paths = [c for c in config or [] if c.startswith("search_path=")]
        assert len(paths) == 1, (name, config)
        assert paths[0].replace('"', "") == f"search_path={schema}, pg_catalog, pg_temp", (name, config)


@pytest.mark.parametrize("topic", ["a b", ".", "..", "topic/x", "t" * 250, "é"])
def test_enqueue_refuses_a_name_kafka_refuses_for_its_topic(conn, schema, topic):
    batch = tracker.open_batch(conn, schema=schema)
    conn.commit()
    before = _state(conn, schema)
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(
            sql.SQL("SELECT * FROM {}.enqueue(%s, %s, %s)").format(sql.Identifier(schema)),
            [batch.id, topic, [b"a"]],
        )
    assert raised.value.sqlstate == "RT007"
    assert raised.value.diag.message_primary.startswith("topic ")
    conn.rollback()
    assert _state(conn, schema) == before


@pytest.mark.parametrize(
    "key, refused",
    [
        ("k" * 1000, False),
        ("\U0001d11e" * 500, False),  # 2,000 bytes in UTF-8
        ("k" * 1001, True),
        ("\U0001d11e" * 501, True),  # 501 characters, 2,004 bytes
        ("é" * 1000, False),  # 2,000 bytes
    ],
)
def test_open_batch_caps_the_user_key_as_the_library_does(conn, schema, key, refused):
    from tracker.core.validate import check_user_key

    call = sql.SQL("SELECT {}.open_batch(%s)").format(sql.Identifier(schema))
    if not refused:
        check_user_key(key)
        (batch_id,) = conn.execute(call, [key]).fetchone()
        stored = conn.execute(
            sql.SQL("SELECT user_key FROM {} WHERE id = %s").format(sql.Identifier(schema, "batch")), [batch_id]
        ).fetchone()
        assert stored == (key,)
        return
    with pytest.raises(tracker.InvalidValue):
        check_user_key(key)
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(call, [key])
    assert raised.value.sqlstate == "RT007"
    assert "user_key" in raised.value.diag.message_primary
