"""The console's two actions (expire a batch, requeue a dead row) go through the admin commands'
code, with an audit line, and read a field given twice the same way on the confirmation page and
in the action."""

from __future__ import annotations

import json
import re
import time
import urllib.parse

import psycopg
from structlog.testing import capture_logs
from support.console import confirmation_of, csrf_of
from support.console_server import VIEWER, cfg, client, server, state_of, viewer  # noqa: F401  (fixtures)
from support.harness import Receiver, running, wait_until
from support.http_server import TOKEN
from test_admin import add_dead

import tracker


def _posts(logs: list[dict]) -> list[dict]:
    """The access lines of the expiry POSTs (a line of a request made before the capture, as the
    login, can still arrive within it)."""
    return [
        e
        for e in logs
        if e.get("event") == "http request" and e.get("method") == "POST" and str(e.get("path")).endswith("/expire")
    ]


def test_expire_from_the_console_is_the_admin_command_with_an_audit_line(server, cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, user_key="stuck", schema=schema)
        tracker.add_items(conn, b, 5, schema=schema)
        complete = tracker.open_batch(conn, schema=schema)
        tracker.close_batch(conn, complete, schema=schema)
    c = client(server, TOKEN)
    confirm = c.get(f"/console/batches/{b.id}/expire")
    assert confirm.status_code == 200 and f"Expire batch {b.id}" in confirm.text
    token = csrf_of(confirm)
    with capture_logs() as logs:
        r = c.post(f"/console/batches/{b.id}/expire", data={"csrf": token, "note": "consumer gone"})
        assert r.status_code == 200 and f"batch {b.id} expired (5 of 5 items pending)" in r.text, r.text
        again = c.post(f"/console/batches/{b.id}/expire", data={"csrf": token})
        assert again.status_code == 200 and "already expired" in again.text
        refused = c.post(f"/console/batches/{complete.id}/expire", data={"csrf": token})
        assert refused.status_code == 409 and "complete" in refused.text
        # The access line is written once the response is sent, so the client can read the
        # response first: wait for the third one before leaving the capture.
        wait_until(lambda: len(_posts(logs)) >= 3, timeout=10)
    audit = [e for e in logs if e.get("action") == "batch-expire"]
    assert [(e["outcome"], e["batch_id"], e["role"], e["token"].startswith("tok-")) for e in audit] == [
        ("done", b.id, "operator", True),
        ("done", b.id, "operator", True),
        ("refused", complete.id, "operator", True),
    ]
    # The access log names who acted too, as it does for the pages they looked at.
    posts = _posts(logs)
    assert [(e["status"], (e["token"] or "").startswith("tok-")) for e in posts] == [
        (200, True),
        (200, True),
        (409, True),
    ], posts
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT action, rows FROM "{schema}".admin_log').fetchall() == [("batch-expire", 1)]
        values = [r[0] for r in conn.execute(f'SELECT value FROM "{schema}".outbox ORDER BY id').fetchall()]
    events = [json.loads(v) for v in values]
    expired = [e for e in events if e.get("event") == "expired"]  # the other: `complete`'s completion
    assert [(e["batch_id"], e["reason"], e["note"]) for e in expired] == [(b.id, "operator", "consumer gone")]


def test_requeue_from_the_console_republishes_a_dead_row_once(server, cfg, pg_dsn, schema, topics, kafka_bootstrap):
    topic = topics("data")
    ids = add_dead(pg_dsn, schema, topic, 3, "operator-test: partition gone")
    other = add_dead(pg_dsn, schema, topic, 2, "too large", prefix="big")
    c = client(server, TOKEN)
    listed = c.get("/console/dead").text  # pages of 3
    nxt = re.search(r'rel="next" href="([^"]+)"', listed)
    assert nxt and "5 </span>" not in listed and ">5</span>" in listed.replace(" ", ""), listed
    listed += c.get(nxt.group(1).replace("&amp;", "&")).text
    assert all(listed.count(f'data-dead="{i}"') == 1 for i in ids + other)
    inspected = c.get(f"/console/dead/{ids[0]}").text
    assert "operator-test: partition gone" in inspected and "dead-1" in inspected and "0x00ff" in inspected
    confirm = c.get("/console/dead/requeue", params={"id": ids[0]})
    assert "Requeue 1 dead row?" in confirm.text
    token, one = csrf_of(confirm), confirmation_of(confirm)
    confirm_reason = c.get("/console/dead/requeue", params={"reason": "too large"})
    assert "Requeue 2 dead rows?" in confirm_reason.text
    receiver = Receiver(kafka_bootstrap, topic)
    try:
        with capture_logs() as logs:
            r = c.post("/console/dead/requeue", data={"csrf": token, "confirm": one, "id": str(ids[0])})
            assert r.status_code == 200 and "requeued 1 rows" in r.text, r.text
            again = c.post("/console/dead/requeue", data={"csrf": token, "confirm": one, "id": str(ids[0])})
            assert again.status_code == 409 and "nothing was requeued" in again.text
            by_reason = c.post(
                "/console/dead/requeue",
                data={"csrf": token, "confirm": confirmation_of(confirm_reason), "reason": "too large"},
            )
            assert by_reason.status_code == 200 and "requeued 2 rows" in by_reason.text
        with running(cfg):
            assert wait_until(lambda: len(receiver.records) >= 3, 30)
            time.sleep(1.0)  # anything published twice would arrive by now
    finally:
        receiver.close()
    assert sorted(receiver.values()) == [b"big-1", b"big-2", b"dead-1"]
    audit = [(e["outcome"], e.get("moved")) for e in logs if e.get("action") == "dead-requeue"]
    assert audit == [("done", 1), ("refused", None), ("done", 2)]
    with psycopg.connect(pg_dsn) as conn:
        left = [r[0] for r in conn.execute(f'SELECT id FROM "{schema}".outbox_dead ORDER BY id').fetchall()]
        logged = conn.execute(f'SELECT action, rows FROM "{schema}".admin_log ORDER BY id').fetchall()
    assert left == ids[1:] and logged == [("dead-requeue", 1), ("dead-requeue", 2)]


def test_a_field_given_twice_is_read_the_same_way_by_the_confirmation_page_and_the_action(server, pg_dsn, schema):
    """`id=A&id=B`: the page and the form both mean B (the last), so what was confirmed is what is done."""
    first, second = add_dead(pg_dsn, schema, "some-topic", 2, "too large")
    c = client(server, TOKEN)
    confirm = c.get(f"/console/dead/requeue?id={first}&id={second}")
    assert confirm.status_code == 200 and "Requeue 1 dead row?" in confirm.text
    assert f"Dead row {second} (" in confirm.text and f"Dead row {first} (" not in confirm.text, confirm.text
    form = [("csrf", csrf_of(confirm)), ("confirm", confirmation_of(confirm)), ("id", str(first)), ("id", str(second))]
    r = c.post(
        "/console/dead/requeue",
        content=urllib.parse.urlencode(form),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and "requeued 1 rows" in r.text, r.text
    with psycopg.connect(pg_dsn) as conn:
        left = [row[0] for row in conn.execute(f'SELECT id FROM "{schema}".outbox_dead').fetchall()]
    assert left == [first]
