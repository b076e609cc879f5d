"""Idempotency-Key on every POST, through a real server on both backends and real Postgres.

A retry with the same key and request returns the first answer and changes nothing; the same key
with another request is refused; concurrent duplicates wait for the first and get its answer; a
request that failed stored nothing; keys belong to a token and expire.
"""

from __future__ import annotations

import threading
import time

import httpx
import psycopg
import pytest
from psycopg import sql
from support.http_server import OTHER_TOKEN, TOKEN, RunningServer, http_config

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(params=["tracker", "sql"])
def server(request, pg_dsn, schema):
    cfg = http_config(pg_dsn, schema, backend=request.param, idempotency_window=3600)
    with RunningServer(cfg, [TOKEN, OTHER_TOKEN]) as s:
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def _count(pg_dsn, schema, table="batch") -> int:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, table))).fetchone()[0]


def _key(k: str) -> dict[str, str]:
    return {"Idempotency-Key": f'"{k}"'}


def test_a_retried_post_returns_the_first_answer_and_changes_nothing(client, pg_dsn, schema):
    first = client.post("/v1/batches", json={"user_key": "k1"}, headers=_key("open-1"))
    again = client.post("/v1/batches", json={"user_key": "k1"}, headers=_key("open-1"))
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json() and again.headers["location"] == first.headers["location"]
    assert again.headers.get("idempotent-replayed") == "true" and "idempotent-replayed" not in first.headers
    assert _count(pg_dsn, schema) == 1
    batch_id = first.json()["batch_id"]
    # the retried add that used to leave a second set of items nobody would ack
    adds = [client.post(f"/v1/batches/{batch_id}/items", json={"count": 5}, headers=_key("add-1")) for _ in range(3)]
    assert [a.json() for a in adds] == [adds[0].json()] * 3
    assert client.get(f"/v1/batches/{batch_id}").json()["total"] == 5
    ids = [f"{batch_id}:{g['group_id']}:{i}" for g in adds[0].json()["groups"] for i in range(g["start"], g["upto"])]
    acks = [client.post("/v1/acks", json={"ids": ids}, headers=_key("ack-1")) for _ in range(2)]
    assert acks[1].json() == acks[0].json() == {"acked": 5, "duplicates": 0, "completed": []}
    closes = [client.post(f"/v1/batches/{batch_id}/close", headers=_key("close-1")) for _ in range(2)]
    assert closes[1].json() == closes[0].json() == {"batch_id": batch_id, "complete": True}
    with psycopg.connect(pg_dsn) as c:
        events = c.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE topic = 'batch-completions'").format(
                sql.Identifier(schema, "outbox")
            )
        ).fetchone()[0]
    assert events == 1


def test_the_same_key_for_another_request_is_refused_and_changes_nothing(client, pg_dsn, schema):
    assert client.post("/v1/batches", json={"user_key": "a"}, headers=_key("k")).status_code == 201
    for other in (
        lambda: client.post("/v1/batches", json={"user_key": "b"}, headers=_key("k")),  # another body
        lambda: client.post("/v1/acks", json={"ids": []}, headers=_key("k")),  # another path
    ):
        r = other()
        assert r.status_code == 422 and r.json()["type"].endswith(":idempotency-key-reused"), r.text
    assert _count(pg_dsn, schema) == 1


def test_concurrent_duplicates_wait_for_the_first_and_get_its_answer(client, pg_dsn, schema):
    batch_id = client.post("/v1/batches", json={}).json()["batch_id"]
    answers: list[httpx.Response] = []
    barrier = threading.Barrier(8)

    def add() -> None:
        barrier.wait()
        answers.append(client.post(f"/v1/batches/{batch_id}/items", json={"count": 7}, headers=_key("same")))

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(answers) == 8 and all(a.status_code == 200 for a in answers)
    assert len({a.text for a in answers}) == 1
    assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 7
    assert client.get(f"/v1/batches/{batch_id}").json()["total"] == 7


def test_a_request_that_failed_stored_nothing_and_its_retry_runs(client, pg_dsn, schema):
    r = client.post("/v1/batches/999999/items", json={"count": 3}, headers=_key("early"))
    assert r.status_code == 404
    assert _count(pg_dsn, schema, "http_idempotency") == 0
    r = client.post("/v1/batches", json={}, headers=_key("early"))  # the key is free: nothing was stored
    assert r.status_code == 201 and "idempotent-replayed" not in r.headers


def test_keys_belong_to_a_token(server, client, pg_dsn, schema):
    mine = client.post("/v1/batches", json={}, headers=_key("shared"))
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {OTHER_TOKEN}"}, timeout=60) as other:
        theirs = other.post("/v1/batches", json={}, headers=_key("shared"))
    assert mine.json()["batch_id"] != theirs.json()["batch_id"] and "idempotent-replayed" not in theirs.headers
    assert _count(pg_dsn, schema) == 2


@pytest.mark.parametrize(
    "headers",
    [
        {"Idempotency-Key": "unquoted"},
        {"Idempotency-Key": '""'},
        {"Idempotency-Key": '"' + "x" * 256 + '"'},
        {"Idempotency-Key": '"tab\there"'},
        [("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')],
    ],
)
def test_a_malformed_or_repeated_key_is_refused_and_nothing_is_done(client, pg_dsn, schema, headers):
    h = list(headers.items()) if isinstance(headers, dict) else headers
    r = client.post("/v1/batches", json={}, headers=[*AUTH.items(), *h])
    assert r.status_code == 400 and r.json()["field"] == "Idempotency-Key", r.text
    assert _count(pg_dsn, schema) == 0


def test_keys_expire_after_the_window_and_are_deleted(pg_dsn, schema):
    cfg = http_config(pg_dsn, schema, idempotency_window=1)
    with (
        RunningServer(cfg, [TOKEN]) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client,
    ):
        first = client.post("/v1/batches", json={}, headers=_key("short"))
        time.sleep(1.5)
        later = client.post("/v1/batches", json={}, headers=_key("short"))
        assert later.status_code == 201 and later.json()["batch_id"] != first.json()["batch_id"]
        assert "idempotent-replayed" not in later.headers
    time.sleep(1.5)
    import asyncio

    from harvester.services.http.backend import TrackerStore
    from harvester.services.http.idempotency import Idempotency

    async def sweep() -> int:
        store = TrackerStore(pg_dsn, schema, completion_topic="batch-completions", pool_size=1, timeout=10)
        await store.open()
        try:
            return await Idempotency(store, 1).expire()
        finally:
            await store.close()

    assert asyncio.run(sweep()) == 1  # the expired key's row goes (the server does this every minute)
    assert _count(pg_dsn, schema, "http_idempotency") == 0
