"""Every error path of the HTTP API, through a real server and client: the status, the RFC 9457
problem document (naming the bad field or id, no stack trace) and that nothing changed in the
database."""

from __future__ import annotations

import socket

import httpx
import psycopg
import pytest
from psycopg import sql
from support.http_server import TOKEN, RunningServer, http_config
from support.ports import free_port

from harvester import config as config_mod

PROBLEM = "application/problem+json"
LIMITS = dict(max_body_bytes=20000, max_ids_per_request=50, max_items_per_add=100000, long_poll_max=5.0)


def snapshot(dsn: str, schema: str) -> tuple:
    """Every row the tracker owns, every column (timestamps included: a touch would show)."""
    with psycopg.connect(dsn) as conn:
        return tuple(
            conn.execute(
                sql.SQL("SELECT to_jsonb(t)::text FROM {} t ORDER BY 1").format(sql.Identifier(schema, table))
            ).fetchall()
            for table in ("batch", "batch_group", "outbox")
        )


@pytest.fixture(params=["tracker"])
def world(request, pg_dsn, schema):
    """A server with small limits; batch A open (10 items in group 0), batch C closed (3 items),
    batch E expired (2 items). Parametrised by backend where a test asks for both."""
    with (
        RunningServer(http_config(pg_dsn, schema, backend=request.param, **LIMITS), [TOKEN]) as s,
        httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c,
    ):
        ids = {}
        for name, n in (("A", 10), ("C", 3), ("E", 2)):
            b = c.post("/v1/batches", json={"user_key": name}).json()["batch_id"]
            c.post(f"/v1/batches/{b}/items", json={"count": n})
            ids[name] = b
        c.post(f"/v1/batches/{ids['C']}/close")
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                sql.SQL("UPDATE {} SET state = 'expired', expired_at = now() WHERE id = %s").format(
                    sql.Identifier(schema, "batch")
                ),
                [ids["E"]],
            )
        ids["unknown"] = max(ids.values()) + 1000
        yield s, c, ids, lambda: snapshot(pg_dsn, schema)


def check(r: httpx.Response, status: int, slug: str, **named: object) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == PROBLEM
    doc = r.json()
    assert doc["type"] == f"urn:outbox-reaper:problem:{slug}"
    assert doc["status"] == status and doc["title"] and doc["detail"]
    assert doc["instance"] == r.request.url.path
    for key, value in named.items():
        assert doc.get(key) == value, (key, doc)
    assert "Traceback" not in r.text and 'File "' not in r.text
    return doc


def test_missing_and_wrong_bearer_tokens(world):
    s, _, ids, state = world
    before = state()
    r = httpx.post(f"{s.url}/v1/acks", json={"ids": [f"{ids['A']}:0:1"]})
    check(r, 401, "unauthorized")
    assert r.headers["www-authenticate"] == 'Bearer realm="reaper"'
    for header in (f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", "Bearer", "Token abc"):
        r = httpx.post(f"{s.url}/v1/acks", json={"ids": [f"{ids['A']}:0:1"]}, headers={"Authorization": header})
        check(r, 401, "unauthorized")
    # authentication comes before the body is looked at
    r = httpx.post(f"{s.url}/v1/acks", content=b"{not json", headers={"content-type": "application/json"})
    check(r, 401, "unauthorized")
    assert state() == before


@pytest.mark.parametrize("world", ["tracker", "sql"], indirect=True)
@pytest.mark.parametrize("bad", ["x", "1:2", "1:a:3", "1:0:3-1", "1:0:-1", "1:0:1 ", "²:0:1"])
def test_malformed_item_id_bulk_names_it(world, bad):
    _, c, ids, state = world
    before = state()
    good = f"{ids['A']}:0:1"
    check(c.post("/v1/acks", json={"ids": [good, bad]}), 400, "malformed-item-id", item_id=bad, field="ids")
    assert state() == before


def test_malformed_item_id_single_names_it(world):
    _, c, ids, state = world
    before = state()
    check(c.post("/v1/acks/7:x:1"), 400, "malformed-item-id", item_id="7:x:1")
    check(c.post(f"/v1/acks/{ids['A']}:0:99999"), 422, "index-out-of-range", item_id=f"{ids['A']}:0:99999")
    assert state() == before


def test_unknown_batch_in_the_path(world):
    _, c, ids, state = world
    before = state()
    u = ids["unknown"]
    check(c.get(f"/v1/batches/{u}"), 404, "unknown-batch", batch_id=u)
    check(c.post(f"/v1/batches/{u}/items", json={"count": 5}), 404, "unknown-batch", batch_id=u)
    check(c.post(f"/v1/batches/{u}/close"), 404, "unknown-batch", batch_id=u)
    check(c.get(f"/v1/batches/{u}/completion", params={"wait": 0}), 404, "unknown-batch", batch_id=u)
    assert state() == before


@pytest.mark.parametrize("world", ["tracker", "sql"], indirect=True)
def test_unknown_batch_group_and_index_in_an_ack_change_nothing(world):
    _, c, ids, state = world
    before = state()
    a, u = ids["A"], ids["unknown"]
    check(
        c.post("/v1/acks", json={"ids": [f"{a}:0:1", f"{u}:0:4"]}),
        422,
        "unknown-batch-in-body",
        batch_id=u,
        item_id=f"{u}:0:4",
        field="ids",
    )
    check(
        c.post("/v1/acks", json={"ids": [f"{a}:0:1", f"{a}:3:2"]}), 422, "unknown-group", item_id=f"{a}:3:2", group_id=3
    )
    check(
        c.post("/v1/acks", json={"ids": [f"{a}:0:1", f"{a}:0:5-10"]}), 422, "index-out-of-range", item_id=f"{a}:0:5-10"
    )  # a run is named as written
    check(c.post("/v1/acks", json={"ids": [f"{a}:0:8192"]}), 422, "index-out-of-range", item_id=f"{a}:0:8192")
    assert state() == before  # the valid '<a>:0:1' of each call was not applied either


@pytest.mark.parametrize("world", ["tracker", "sql"], indirect=True)
def test_add_after_close_and_after_expiry(world):
    _, c, ids, state = world
    before = state()
    check(
        c.post(f"/v1/batches/{ids['C']}/items", json={"count": 1}),
        409,
        "batch-not-open",
        batch_id=ids["C"],
        state="closed",
    )
    check(
        c.post(f"/v1/batches/{ids['E']}/items", json={"count": 1}),
        409,
        "batch-not-open",
        batch_id=ids["E"],
        state="expired",
    )
    check(c.post(f"/v1/batches/{ids['E']}/close"), 410, "batch-expired", batch_id=ids["E"])
    check(
        c.post("/v1/acks", json={"ids": [f"{ids['E']}:0:0"]}),
        410,
        "batch-expired",
        batch_id=ids["E"],
        item_id=f"{ids['E']}:0:0",
    )
    assert state() == before


@pytest.mark.parametrize("world", ["tracker", "sql"], indirect=True)
def test_a_route_documents_the_errors_it_answers_each_under_its_code(world):
    s, c, ids, _ = world
    served = httpx.get(s.url + "/v1/openapi.json").json()["paths"]
    # an expired batch reads as 200 with its state: the status route documents no 410
    r = c.get(f"/v1/batches/{ids['E']}")
    assert r.status_code == 200 and r.json()["state"] == "expired", r.text
    assert "410" not in served["/v1/batches/{batch_id}"]["get"]["responses"]
    # problem types sharing a status code share its entry: none is lost
    opened = served["/v1/batches"]["post"]["responses"]
    for title in ("Batches nest too deep", "Idempotency-Key used for another request", "Unknown batch"):
        assert title in opened["422"]["description"], opened["422"]
    assert opened["409"]["description"] == "Parent batch is not open"
    acked = served["/v1/acks"]["post"]["responses"]["422"]["description"]
    for title in ("Unknown group", "Item index out of range", "Unknown batch"):
        assert title in acked, acked
    # and a 422 each of those names is answered as documented
    check(c.post("/v1/batches", json={"parent": ids["unknown"]}), 422, "unknown-batch-in-body")
    check(c.post("/v1/acks", json={"ids": [f"{ids['A']}:7:0"]}), 422, "unknown-group")


def test_oversized_bodies(world):
    s, c, ids, state = world
    before = state()
    big = {"ids": [f"{ids['A']}:0:1"] * 3000}  # ~40 KB > max_body_bytes
    check(c.post("/v1/acks", json=big), 413, "payload-too-large", field="body")

    def chunks():  # no Content-Length: the limit must hold while reading
        for _ in range(100):
            yield b" " * 1000

    r = c.post("/v1/acks", content=chunks(), headers={"content-type": "application/json"})
    # named as the Content-Length refusal is: the body and its limit
    check(r, 413, "payload-too-large", field="body", limit=LIMITS["max_body_bytes"])
    check(
        c.post("/v1/acks", json={"ids": [f"{ids['A']}:0:1"] * 51}), 413, "payload-too-large", field="body.ids", limit=50
    )
    check(
        c.post(f"/v1/batches/{ids['A']}/items", json={"count": 100001}),
        400,
        "invalid-request",
        field="body.count",
        limit=100000,
    )
    assert state() == before


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/batches/{A}/items", {"count": "5"}, "body.count"),
        ("/v1/batches/{A}/items", {"count": True}, "body.count"),
        ("/v1/batches/{A}/items", {"count": -1}, "body.count"),
        ("/v1/batches/{A}/items", {"count": 1, "extra": 2}, "body.extra"),
        ("/v1/batches/{A}/items", {}, "body.count"),
        ("/v1/batches/{A}/items", [1], "body"),
        ("/v1/acks", {"ids": "1:0:1"}, "body.ids"),
        ("/v1/acks", {"ids": [1]}, "body.ids.0"),
        ("/v1/batches", {"user_key": 5}, "body.user_key"),
        ("/v1/batches", {"completion_topic": "bad topic!"}, "body.completion_topic"),
        ("/v1/batches", {"user_key": "nul\u0000"}, "body.user_key"),
    ],
)
def test_invalid_bodies_name_the_field(world, path, body, field):
    _, c, ids, state = world
    before = state()
    check(c.post(path.format(A=ids["A"]), json=body), 400, "invalid-request", field=field)
    assert state() == before


def test_invalid_json_path_query_media_type_route_and_method(world):
    _, c, ids, state = world
    before = state()
    check(
        c.post("/v1/acks", content=b"{", headers={"content-type": "application/json"}),
        400,
        "invalid-request",
        field="body",
    )
    # a lone surrogate is valid JSON but not UTF-8 text: the tracker refuses it, naming the field
    check(
        c.post("/v1/batches", content=b'{"user_key": "\\ud800"}', headers={"content-type": "application/json"}),
        400,
        "invalid-request",
        field="body.user_key",
    )
    check(c.get("/v1/batches/abc"), 400, "invalid-request", field="path.batch_id")
    check(c.get("/v1/batches/99999999999999999999"), 400, "invalid-request", field="path.batch_id")
    check(c.get(f"/v1/batches/{ids['A']}/completion", params={"wait": 6}), 400, "invalid-request", field="query.wait")
    check(
        c.get(f"/v1/batches/{ids['A']}/completion", params={"wait": "soon"}), 400, "invalid-request", field="query.wait"
    )
    for written in ("1e400", "inf", "9" * 400):  # named as written, not as the number it parses to
        r = c.get(f"/v1/batches/{ids['A']}/completion", params={"wait": written})
        check(r, 400, "invalid-request", field="query.wait")
        assert r.json()["detail"].startswith(f"wait {written[:40]}"), r.text
    check(
        c.post("/v1/acks", content=b"ids=1", headers={"content-type": "application/x-www-form-urlencoded"}),
        415,
        "unsupported-media-type",
        field="Content-Type",
    )
    check(c.get("/v1/nothing-here"), 404, "not-found")
    check(c.delete(f"/v1/batches/{ids['A']}"), 405, "method-not-allowed")
    assert state() == before


def test_rate_limit_per_token(pg_dsn, schema):
    other = "rate-token-other-0123456789"
    with RunningServer(http_config(pg_dsn, schema, rate_limit=0.01, rate_burst=2), [TOKEN, other]) as s:
        before = snapshot(pg_dsn, schema)
        h = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{s.url}/v1/batches/1", headers=h).status_code == 404
        assert httpx.get(f"{s.url}/v1/batches/1", headers=h).status_code == 404
        r = httpx.post(f"{s.url}/v1/batches", headers=h, json={})
        check(r, 429, "rate-limited")
        assert int(r.headers["retry-after"]) >= 1
        # another token has its own bucket
        assert httpx.get(f"{s.url}/v1/batches/1", headers={"Authorization": f"Bearer {other}"}).status_code == 404
        assert snapshot(pg_dsn, schema) == before


def test_internal_error_is_a_bare_500_without_a_trace(world, pg_dsn, schema):
    _, c, ids, state = world
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a real fault: a column and a function are gone
        conn.execute(sql.SQL("DROP FUNCTION {}.batch_status(bigint)").format(sql.Identifier(schema)))
        conn.execute(
            sql.SQL("ALTER TABLE {} RENAME COLUMN user_key TO user_key_gone").format(sql.Identifier(schema, "batch"))
        )
    before = state()
    r = c.get(f"/v1/batches/{ids['A']}")
    doc = check(r, 500, "internal")
    assert doc["request_id"] == r.headers["x-request-id"]
    assert "batch_status" not in r.text and "user_key" not in r.text and "psycopg" not in r.text
    assert state() == before


def test_database_unavailable_is_503_and_not_ready(pg_dsn, schema):
    port = free_port()  # nothing listening
    cfg = http_config(f"postgresql://postgres@127.0.0.1:{port}/outbox?connect_timeout=1", schema, request_timeout=1.0)
    with RunningServer(cfg, [TOKEN]) as s:
        r = httpx.post(f"{s.url}/v1/batches", json={}, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        check(r, 503, "unavailable")
        assert r.headers["retry-after"] == "1"
        assert httpx.get(f"{s.url}/readyz", timeout=30).status_code == 503
        assert httpx.get(f"{s.url}/healthz").status_code == 200


def test_every_ack_topic_of_the_configuration_is_no_completion_topic(pg_dsn, schema):
    """Completions written to another outbox schema's ack topic would be read there as acks."""
    cfg = config_mod.load(
        environ={},
        overrides={
            "database": {"dsn": pg_dsn, "schema": schema},
            "harvester": {
                "outboxes": [{"name": "main"}, {"name": "other", "schema": "other", "ack_topic": "other-acks"}]
            },
            "logging": {"level": "warning"},
        },
    )
    with RunningServer(cfg, [TOKEN]) as server:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as client:
            for topic in ("other-acks", cfg.acker.topic):
                r = client.post("/v1/batches", json={"completion_topic": topic})
                assert r.status_code == 403 and r.json()["type"].endswith(":forbidden"), r.text
            assert client.post("/v1/batches", json={"completion_topic": "other-done"}).status_code == 201
