"""Real completion and expiry events, of every shape the tracker writes, validate against the JSON
Schemas the event reference is generated from; and the schemas are strict enough to refuse events
that break them."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

import tracker
from tracker import event_schema, outbox
from tracker.expiry import expire_batch, sweep

VALIDATOR = jsonschema.Draft202012Validator


def _events(conn, schema: str) -> list[dict]:
    rows = conn.execute(f'SELECT value FROM "{schema}".outbox WHERE topic IN (%s, %s) ORDER BY id', ["done", "gone"])
    return [json.loads(bytes(v)) for (v,) in rows.fetchall()]


def _check(event: dict) -> None:
    name = "batch-completed" if event["event"] == "batch.completed" else "batch-expired"
    VALIDATOR(event_schema.SCHEMAS[name], format_checker=VALIDATOR.FORMAT_CHECKER).validate(event)


def test_the_schemas_are_valid_json_schemas():
    for schema in event_schema.SCHEMAS.values():
        VALIDATOR.check_schema(schema)


def test_every_kind_of_real_event_validates(conn, schema):
    # succeeded; failed with a reason; a parent with a child; early finish by a threshold; empty
    ok = tracker.open_batch(conn, user_key="ok", completion_topic="done", schema=schema)
    outbox.enqueue(conn, ok, [b"x"] * 3, topic="work", schema=schema)
    tracker.close_batch(conn, ok, schema=schema)
    tracker.ack(conn, [f"{ok.id}:0:0-2"], schema=schema)
    bad = tracker.open_batch(conn, completion_topic="done", schema=schema)
    tracker.add_items(conn, bad, 2, schema=schema)
    tracker.close_batch(conn, bad, schema=schema)
    tracker.fail(conn, [f"{bad.id}:0:0"], "timed out", schema=schema)
    tracker.ack(conn, [f"{bad.id}:0:1"], schema=schema)
    parent = tracker.open_batch(conn, user_key="parent", completion_topic="done", schema=schema)
    child = tracker.open_batch(conn, parent=parent, completion_topic="done", schema=schema)
    tracker.add_items(conn, child, 1, schema=schema)
    tracker.close_batch(conn, child, schema=schema)
    tracker.close_batch(conn, parent, schema=schema)
    tracker.ack(conn, [f"{child.id}:0:0"], schema=schema)
    early = tracker.open_batch(conn, completion_topic="done", tolerated_failures=0, schema=schema)
    tracker.add_items(conn, early, 5, schema=schema)
    tracker.close_batch(conn, early, schema=schema)
    tracker.fail(conn, [f"{early.id}:0:0"], "bad row", schema=schema)
    empty = tracker.open_batch(conn, completion_topic="done", schema=schema)
    tracker.close_batch(conn, empty, schema=schema)
    # expired: by the sweeper (open, idle) and by an operator (closed, with a note)
    idle = tracker.open_batch(conn, completion_topic="gone", schema=schema)
    tracker.add_items(conn, idle, 2, schema=schema)
    by_hand = tracker.open_batch(conn, completion_topic="gone", schema=schema)
    tracker.add_items(conn, by_hand, 2, schema=schema)
    tracker.close_batch(conn, by_hand, schema=schema)
    conn.commit()
    conn.execute(
        f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '2 hours' WHERE id = %s", [idle.id]
    )
    conn.commit()
    sweep(conn, schema=schema, idle_expiry=3600, retention=86400, completion_topic="done")
    expire_batch(conn, by_hand.id, schema=schema, note="stuck upstream")
    conn.commit()

    events = _events(conn, schema)
    kinds = sorted((e["event"], e["outcome"]) for e in events)
    assert kinds == sorted(
        [("batch.completed", "succeeded")] * 4 + [("batch.completed", "failed")] * 2 + [("expired", "expired")] * 2
    ), kinds
    for event in events:
        _check(event)
    assert {e.get("note") for e in events if e["event"] == "expired"} == {None, "stuck upstream"}


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda e: e.pop("batch_id"), "batch_id"),
        (lambda e: e.update(outcome="maybe"), "outcome"),
        (lambda e: e.update(failed=-1), "failed"),
        (lambda e: e.update(completed_at="yesterday"), "completed_at"),
        (lambda e: e["rollup"].pop("total"), "total"),
        (lambda e: e.update(schema_version=3), "schema_version"),
    ],
)
def test_the_schema_refuses_a_broken_event(change, where):
    event = {
        "event": "batch.completed",
        "schema_version": 2,
        "outcome": "succeeded",
        "batch_id": 1,
        "user_key": None,
        "total": 1,
        "succeeded": 1,
        "failed": 0,
        "pending": 0,
        "parent_id": None,
        "children": {"total": 0, "failed": 0},
        "rollup": {"total": 1, "succeeded": 1, "failed": 0},
        "opened_at": "2026-11-22T07:20:01.123456+00:00",
        "closed_at": "2026-11-22T07:20:02+00:00",
        "completed_at": "2026-11-22T07:20:03+00:00",
    }
    _check(copy.deepcopy(event))
    broken = copy.deepcopy(event)
    change(broken)
    with pytest.raises(jsonschema.ValidationError, match=where):
        _check(broken)
