"""The HTTP API through a real uvicorn server and a real HTTP client (httpx), on real Postgres."""

from __future__ import annotations

import json
import threading

import httpx
import psycopg
import pytest
from psycopg import sql
from support.http_server import OTHER_TOKEN, TOKEN, RunningServer, http_config

import tracker
from harvester.services.http import openapi


@pytest.fixture(params=["tracker"])
def server(request, pg_dsn, schema):
    cfg = http_config(pg_dsn, schema, completion_poll_interval=0.05, backend=request.param)
    with RunningServer(cfg, [TOKEN, OTHER_TOKEN]) as s:
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        yield c


def _ids(batch_id: int, groups: list[dict]) -> list[str]:
    return [f"{batch_id}:{g['group_id']}:{i}" for g in groups for i in range(g["start"], g["upto"])]


@pytest.mark.parametrize("server", ["tracker", "sql"], indirect=True)
def test_fan_out_walkthrough_and_exactly_one_completion_event(client, pg_dsn, schema):
    r = client.post("/v1/batches", json={"user_key": "catalog-7", "completion_topic": "http-done"})
    assert r.status_code == 201, r.text
    b = r.json()["batch_id"]
    assert r.headers["location"] == f"/v1/batches/{b}"
    assert r.json()["state"] == "open" and r.json()["user_key"] == "catalog-7"
    first = client.post(f"/v1/batches/{b}/items", json={"count": 8000}).json()
    assert first == {"batch_id": b, "count": 8000, "groups": [{"group_id": 0, "start": 0, "upto": 8000}]}
    second = client.post(f"/v1/batches/{b}/items", json={"count": 400}).json()  # tops up group 0
    assert second["groups"] == [{"group_id": 0, "start": 8000, "upto": 8192}, {"group_id": 1, "start": 0, "upto": 208}]
    assert client.post(f"/v1/batches/{b}/close").json() == {"batch_id": b, "complete": False}
    ids = _ids(b, first["groups"] + second["groups"])
    assert len(ids) == 8400
    r = client.post("/v1/acks", json={"ids": ids[:8000] + [ids[0]]})
    assert r.json() == {"acked": 8000, "duplicates": 1, "completed": []}
    status = client.get(f"/v1/batches/{b}").json()
    assert (status["state"], status["total"], status["pending"], status["complete"]) == ("closed", 8400, 400, False)
    assert client.post(f"/v1/acks/{b}:0:8000-8191").json() == {"acked": 192, "duplicates": 0, "completed": []}
    r = client.post("/v1/acks", json={"ids": [f"{b}:1:0-206"]})
    assert r.json()["acked"] == 207
    last = client.post(f"/v1/acks/{b}:1:207").json()
    assert last == {"acked": 1, "duplicates": 0, "completed": [b]}
    assert client.post(f"/v1/acks/{b}:1:207").json() == {"acked": 0, "duplicates": 1, "completed": []}
    done = client.get(f"/v1/batches/{b}/completion", params={"wait": 0}).json()
    assert done["complete"] is True and done["pending"] == 0 and done["completed_at"]
    with psycopg.connect(pg_dsn) as conn:
        events = conn.execute(
            sql.SQL("SELECT value FROM {} WHERE topic = 'http-done'").format(sql.Identifier(schema, "outbox"))
        ).fetchall()
    assert len(events) == 1 and json.loads(events[0][0])["user_key"] == "catalog-7"


def test_close_of_an_empty_batch_completes_it(client):
    b = client.post("/v1/batches").json()["batch_id"]  # no body at all
    assert client.post(f"/v1/batches/{b}/close").json() == {"batch_id": b, "complete": True}
    assert client.post(f"/v1/batches/{b}/close").json() == {"batch_id": b, "complete": True}


def test_long_poll_answers_when_another_process_completes_the_batch(client, pg_dsn, schema):
    b = client.post("/v1/batches").json()["batch_id"]
    client.post(f"/v1/batches/{b}/items", json={"count": 3})
    client.post(f"/v1/batches/{b}/close")
    got: dict = {}

    def poll() -> None:
        got["r"] = client.get(f"/v1/batches/{b}/completion", params={"wait": 50})

    t = threading.Thread(target=poll)
    t.start()
    # Completed outside this server: the Python API in its own transaction (as a consumer would).
    with psycopg.connect(pg_dsn) as conn:
        assert tracker.ack(conn, [f"{b}:0:0-2"], schema=schema).acked == 3  # claims: settled at commit
        conn.commit()
        assert tracker.status(conn, b, schema=schema).state == "complete"
    t.join(timeout=55)
    assert not t.is_alive()
    assert got["r"].status_code == 200 and got["r"].json()["state"] == "complete"


def test_long_poll_returns_the_open_state_after_its_wait(client):
    b = client.post("/v1/batches").json()["batch_id"]
    r = client.get(f"/v1/batches/{b}/completion", params={"wait": 0.2})
    assert r.status_code == 200 and r.json()["state"] == "open" and r.json()["complete"] is False


def test_a_second_token_works_and_is_logged_by_its_id_only(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"bearer {OTHER_TOKEN}"}) as c:
        assert c.post("/v1/batches", json={}).status_code == 201


def test_checked_in_openapi_document_equals_the_served_one(server):
    served = httpx.get(server.url + "/v1/openapi.json").json()  # no token needed for the document
    assert openapi.render(served) == openapi.CHECKED_IN.read_text(), (
        "harvester/services/http/openapi.json is stale: run .venv/bin/python -m harvester.services.http.openapi > harvester/services/http/openapi.json"
    )
    assert set(served["paths"]) == {
        "/v1/batches",
        "/v1/batches/{batch_id}",
        "/v1/batches/{batch_id}/items",
        "/v1/batches/{batch_id}/close",
        "/v1/batches/{batch_id}/completion",
        "/v1/batches/{batch_id}/events",
        "/v1/batches/{batch_id}/failures",
        "/v1/acks",
        "/v1/acks/{item_id}",
        "/v1/failures",
    }
    ack = served["paths"]["/v1/acks"]["post"]["responses"]
    assert {"200", "400", "401", "413", "422", "429"} <= set(ack)
    assert "application/problem+json" in ack["400"]["content"]


def test_health_readiness_and_metrics_by_route(client, server):
    assert httpx.get(server.url + "/healthz").text == "ok\n"
    assert httpx.get(server.url + "/readyz").status_code == 200
    b = client.post("/v1/batches").json()["batch_id"]
    client.get(f"/v1/batches/{b}")
    client.get("/v1/batches/999999")
    text = httpx.get(server.url + "/metrics").text
    assert 'reaper_http_requests_total{method="GET",route="/v1/batches/{batch_id}",status="200"}' in text
    assert 'reaper_http_requests_total{method="GET",route="/v1/batches/{batch_id}",status="404"}' in text
    assert 'reaper_http_errors_total{problem="unknown-batch",route="/v1/batches/{batch_id}"}' in text
    assert 'reaper_http_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/batches"}' in text
    assert f'/v1/batches/{b}"' not in text  # raw paths never become labels


# On the worker of every other PgBouncer test (tests/test_pgbouncer.py reads a setting from each of
# the pool's server connections at once, which needs the whole pool: a client elsewhere holding one
# in a transaction then keeps it waiting, and PgBouncer gives up after query_wait_timeout).
@pytest.mark.xdist_group("pgbouncer")
@pytest.mark.parametrize("backend", ["tracker", "sql"])
def test_through_pgbouncer_in_transaction_mode(pgbouncer_dsn, pgbouncer_schema, backend):
    """The server works through a transaction pooler, past psycopg's prepare threshold. (The local
    PgBouncer carries prepared statements itself, so this does not prove the server's pooler
    detection, which matters for PgBouncer < 1.21.)"""
    cfg = http_config(pgbouncer_dsn, pgbouncer_schema, backend=backend, pool_size=3)
    with (
        RunningServer(cfg, [TOKEN]) as s,
        httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c,
    ):
        for _ in range(12):
            b = c.post("/v1/batches", json={}).json()["batch_id"]
            groups = c.post(f"/v1/batches/{b}/items", json={"count": 2}).json()["groups"]
            assert c.post(f"/v1/batches/{b}/close").json()["complete"] is False
            assert c.post("/v1/acks", json={"ids": _ids(b, groups)}).json()["completed"] == [b]
            assert c.get(f"/v1/batches/{b}").json()["state"] == "complete"


def test_server_sent_events_end_with_the_completion(server, client, pg_dsn, schema):
    b = client.post("/v1/batches").json()["batch_id"]
    client.post(f"/v1/batches/{b}/items", json={"count": 2})
    client.post(f"/v1/batches/{b}/close")
    events: list[tuple[str, dict]] = []
    with client.stream("GET", f"/v1/batches/{b}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if kind == "status":  # the first event is out: complete the batch elsewhere
                    with psycopg.connect(pg_dsn) as conn:
                        tracker.ack(conn, [f"{b}:0:0-1"], schema=schema)
                        conn.commit()
    assert [k for k, _ in events] == ["status", "complete"]
    assert events[0][1]["state"] == "closed" and events[1][1]["pending"] == 0
    missing = client.get("/v1/batches/999999/events")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/problem+json"
