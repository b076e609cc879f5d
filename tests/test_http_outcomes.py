"""Outcomes over HTTP, through a real server on both backends: failures posted with a reason, read
back a page at a time, batches opened under a parent and with thresholds, the status's outcome and
counts, and the same rules as acks (tenants, Idempotency-Key, limits, typed errors naming the value)."""

from __future__ import annotations

import json

import httpx
import psycopg
import pytest
from psycopg import sql
from support.http_server import TOKEN, RunningServer, http_config


@pytest.fixture(params=["tracker", "sql"])
def client(request, pg_dsn, schema):
    cfg = http_config(pg_dsn, schema, backend=request.param, max_ids_per_request=50)
    with (
        RunningServer(cfg, [TOKEN]) as s,
        httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c,
    ):
        yield c


def _events(pg_dsn: str, schema: str) -> list[dict]:
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(
            sql.SQL("SELECT value FROM {} WHERE topic = 'batch-completions' ORDER BY id").format(
                sql.Identifier(schema, "outbox")
            )
        ).fetchall()
    return [json.loads(bytes(v)) for (v,) in rows]


def _table(pg_dsn: str, schema: str) -> list[tuple]:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            sql.SQL("SELECT id, state, total, pending, failed, late, outcome FROM {} ORDER BY id").format(
                sql.Identifier(schema, "batch")
            )
        ).fetchall()


def test_a_threshold_and_a_child_finish_a_parent_failed_with_its_failures_paged(client, pg_dsn, schema):
    parent = client.post("/v1/batches", json={"user_key": "p", "tolerated_failures": 1}).json()["batch_id"]
    r = client.post("/v1/batches", json={"user_key": "c", "parent": parent})
    assert r.status_code == 201 and r.json()["parent_id"] == parent, r.text
    child = r.json()["batch_id"]
    client.post(f"/v1/batches/{parent}/items", json={"count": 5})
    client.post(f"/v1/batches/{child}/items", json={"count": 2})
    s = client.get(f"/v1/batches/{parent}").json()
    assert (s["children_open"], s["outcome"], s["failed"], s["succeeded"]) == (1, None, 0, 0)
    assert client.get(f"/v1/batches/{child}").json()["parent_id"] == parent

    r = client.post("/v1/failures", json={"ids": [f"{parent}:0:0"], "reason": "timeout"})
    assert r.json() == {"failed": 1, "duplicates": 0, "completed": []}, r.text  # 1 tolerated
    r = client.post("/v1/acks", json={"ids": [f"{parent}:0:1", f"{child}:0:0-1"]})
    assert r.json()["acked"] == 3
    client.post(f"/v1/batches/{child}/close")
    r = client.post("/v1/failures", json={"ids": [f"{parent}:0:2-3", f"{parent}:0:0"], "reason": "bad row"})
    # an item's first outcome wins; past the threshold the parent finishes early, open and all
    assert r.json() == {"failed": 2, "duplicates": 1, "completed": [parent]}
    assert client.post(f"/v1/batches/{parent}/close").json()["complete"] is True
    s = client.get(f"/v1/batches/{parent}").json()
    assert (s["state"], s["outcome"], s["failed"], s["succeeded"], s["pending"]) == ("complete", "failed", 3, 1, 1)
    assert s["children_open"] == 0 and s["parent_id"] is None
    assert (s["children"], s["children_failed"]) == (1, 0)  # the child finished succeeded
    c = client.get(f"/v1/batches/{child}").json()
    assert (c["outcome"], c["succeeded"], c["failed"]) == ("succeeded", 2, 0)
    # a failure after it finished is counted late, changing no outcome
    assert client.post("/v1/failures", json={"ids": [f"{parent}:0:4"], "reason": "late"}).json()["failed"] == 1
    s = client.get(f"/v1/batches/{parent}").json()
    assert (s["outcome"], s["late"], s["failed"]) == ("failed", 1, 4)

    pages, after = [], None
    while True:
        q = {"limit": 2, **({"after": after} if after else {})}
        page = client.get(f"/v1/batches/{parent}/failures", params=q).json()
        pages.append([(f["item_id"], f["reason"]) for f in page["failures"]])
        after = page["next"]
        if after is None:
            break
    assert pages == [
        [(f"{parent}:0:0", "timeout"), (f"{parent}:0:2", "bad row")],
        [(f"{parent}:0:3", "bad row"), (f"{parent}:0:4", "late")],
        [],
    ]
    events = {e["batch_id"]: e for e in _events(pg_dsn, schema)}
    assert sorted(events) == [parent, child]  # one event each
    assert (events[parent]["outcome"], events[parent]["failed"], events[child]["outcome"]) == (
        "failed",
        3,
        "succeeded",
    )


@pytest.mark.parametrize(
    ("body", "field", "shown"),
    [
        ({"tolerated_failures": -1}, "body.tolerated_failures", "-1"),
        ({"tolerated_failure_ratio": 1.5}, "body.tolerated_failure_ratio", "1.5"),
        ({"parent": -3}, "body.parent", "-3"),
        ({"tolerated_failures": "2"}, "body.tolerated_failures", None),
        ({"tolerated_failure_ratio": True}, "body.tolerated_failure_ratio", None),
    ],
)
def test_bad_thresholds_and_parents_are_refused_naming_the_value(client, pg_dsn, schema, body, field, shown):
    before = _table(pg_dsn, schema)
    r = client.post("/v1/batches", json=body)
    assert r.status_code == 400, r.text
    doc = r.json()
    assert doc["type"].endswith(":invalid-request") and doc["field"].startswith(field), doc
    if shown is not None:
        assert shown in doc["detail"], doc
    assert _table(pg_dsn, schema) == before


def test_an_unknown_closed_or_too_deep_parent_is_a_typed_error(client, pg_dsn, schema):
    r = client.post("/v1/batches", json={"parent": 999999})
    assert r.status_code == 422 and r.json()["type"].endswith(":unknown-batch-in-body"), r.text
    assert (r.json()["field"], r.json()["batch_id"]) == ("body.parent", 999999)
    closed = client.post("/v1/batches", json={}).json()["batch_id"]
    client.post(f"/v1/batches/{closed}/close")
    r = client.post("/v1/batches", json={"parent": closed})
    assert r.status_code == 409 and r.json()["type"].endswith(":parent-not-open"), r.text
    assert (r.json()["batch_id"], r.json()["state"]) == (closed, "complete")
    chain = [client.post("/v1/batches", json={}).json()["batch_id"]]
    for _ in range(7):
        chain.append(client.post("/v1/batches", json={"parent": chain[-1]}).json()["batch_id"])
    before = _table(pg_dsn, schema)
    r = client.post("/v1/batches", json={"parent": chain[-1]})
    assert r.status_code == 422 and r.json()["type"].endswith(":nesting-too-deep"), r.text
    assert r.json()["batch_id"] == chain[-1]
    assert _table(pg_dsn, schema) == before


def test_failures_are_checked_as_acks_are_and_change_nothing_when_refused(client, pg_dsn, schema):
    b = client.post("/v1/batches", json={}).json()["batch_id"]
    client.post(f"/v1/batches/{b}/items", json={"count": 3})
    before = _table(pg_dsn, schema)
    for body, slug, field, shown in (
        ({"ids": [f"{b}:0:0"], "reason": ""}, "invalid-request", "body.reason", "''"),
        ({"ids": [f"{b}:0:0"], "reason": "x" * 501}, "invalid-request", "body.reason", "501"),
        ({"ids": [f"{b}:0:0"], "reason": "a\x00b"}, "invalid-request", "body.reason", "NUL"),
        ({"ids": [f"{b}:0:0"]}, "invalid-request", "body.reason", None),
        ({"ids": [f"{b}:0:0", "nope"], "reason": "r"}, "malformed-item-id", "ids", "nope"),
        ({"ids": [f"{b}:0:0", f"{b}:0:3"], "reason": "r"}, "index-out-of-range", "ids", f"{b}:0:3"),
        ({"ids": [f"{b}:0:0", f"{b}:7:0"], "reason": "r"}, "unknown-group", "ids", f"{b}:7:0"),
        ({"ids": [f"{b}:0:0", "99999:0:0"], "reason": "r"}, "unknown-batch-in-body", "ids", "99999:0:0"),
        ({"ids": [f"{b}:0:0"] * 51, "reason": "r"}, "payload-too-large", "body.ids", "51"),
    ):
        r = client.post("/v1/failures", json=body)
        doc = r.json()
        assert doc["type"].endswith(":" + slug) and doc.get("field") == field, (body, doc)
        if shown is not None:
            assert shown in doc["detail"], (body, doc)
    assert _table(pg_dsn, schema) == before
    for params, shown in (({"limit": 0}, "0"), ({"limit": 1001}, "1001"), ({"after": "1:x"}, "1:x")):
        r = client.get(f"/v1/batches/{b}/failures", params=params)
        assert r.status_code == 400 and shown in r.json()["detail"], r.text
    r = client.get(f"/v1/batches/{b}/failures", params={"after": f"{b + 1}:0:0"})  # another batch's id
    assert r.status_code == 400 and r.json()["field"] == "query.after", r.text
    assert client.get("/v1/batches/99999/failures").status_code == 404


def test_an_after_whose_index_no_group_holds_is_refused_naming_it(client):
    b = client.post("/v1/batches", json={}).json()["batch_id"]
    client.post(f"/v1/batches/{b}/items", json={"count": 3})
    assert client.get(f"/v1/batches/{b}/failures", params={"after": f"{b}:0:8191"}).status_code == 200
    for after in (f"{b}:0:8192", f"{b}:0:9999", f"{b}:0:99999", f"{b}:0:1-8192"):
        r = client.get(f"/v1/batches/{b}/failures", params={"after": after})
        assert r.status_code == 400 and r.json()["type"].endswith(":invalid-request"), (after, r.text)
        assert r.json()["field"] == "query.after" and after in r.json()["detail"], r.text


def test_a_failure_is_replayed_by_its_idempotency_key(client, pg_dsn, schema):
    b = client.post("/v1/batches", json={}).json()["batch_id"]
    client.post(f"/v1/batches/{b}/items", json={"count": 2})
    client.post(f"/v1/batches/{b}/close")
    body = {"ids": [f"{b}:0:0-1"], "reason": "gone"}
    first = client.post("/v1/failures", json=body, headers={"Idempotency-Key": '"f-1"'})
    again = client.post("/v1/failures", json=body, headers={"Idempotency-Key": '"f-1"'})
    assert first.json() == again.json() == {"failed": 2, "duplicates": 0, "completed": [b]}
    assert again.headers["idempotent-replayed"] == "true"
    other = client.post("/v1/failures", json={**body, "reason": "else"}, headers={"Idempotency-Key": '"f-1"'})
    assert other.status_code == 422 and other.json()["type"].endswith(":idempotency-key-reused")
    assert _table(pg_dsn, schema)[-1][1:] == ("complete", 2, 0, 2, 0, "failed")
    assert len(_events(pg_dsn, schema)) == 1
