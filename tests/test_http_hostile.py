"""The HTTP service read as a hostile client would, through a real server on both backends.

The rules: text in a body is valid UTF-8 without NUL, a body names each key once, holds only
JSON's numbers (no NaN, Infinity or overflow) and nests at most 64 deep, or it is refused (400,
naming the field); a batch id in a path is a plain decimal or refused, and nothing is
done; one Authorization header; a request framed by both Content-Length and Transfer-Encoding is
refused and its connection closed, so nothing hidden behind it runs; metric labels come from a
closed set; /readyz asks the database at most once a second whoever calls it.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from support.http_server import TOKEN, RunningServer, http_config

from harvester.services.http.backend import StoreUnavailable
from harvester.services.http.health import Readiness

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(params=["tracker", "sql"])
def server(request, pg_dsn, schema):
    with RunningServer(http_config(pg_dsn, schema, backend=request.param), [TOKEN]) as s:
        yield s


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def _problem(r: httpx.Response, status: int, slug: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    doc = r.json()
    assert doc["type"].endswith(":" + slug), doc
    assert "Traceback" not in r.text and "SELECT" not in r.text
    return doc


def _open(client) -> int:
    return client.post("/v1/batches", json={}).json()["batch_id"]


@pytest.mark.parametrize(
    "body, field",
    [
        (b'{"ids": ["1:0:0", "1:0:\\ud800"]}', "body.ids[1]"),  # an unpaired surrogate
        (b'{"ids": ["1:0:\\udc00x"]}', "body.ids[0]"),
        (b'{"ids": ["1:0:0\\u0000"]}', "body.ids[0]"),  # a NUL
        (b'{"ids": ["1:0:0"], "ids": ["2:0:0"]}', "body"),  # a key twice: which one wins?
        (b'{"ids": ["1:0:\xff"]}', "body"),  # not UTF-8
    ],
)
def test_text_that_cannot_be_read_one_way_is_refused_with_a_400(client, body, field):
    r = client.post("/v1/acks", content=body, headers={"Content-Type": "application/json"})
    doc = _problem(r, 400, "invalid-request")
    assert doc["field"] == field


def test_a_user_key_with_a_surrogate_or_nul_is_refused_and_no_batch_is_opened(client, pg_dsn, schema):
    import psycopg

    for body in (b'{"user_key": "a\\ud83d"}', b'{"user_key": "a\\u0000"}', b'{"completion_topic": "\\udfff"}'):
        r = client.post("/v1/batches", content=body, headers={"Content-Type": "application/json"})
        _problem(r, 400, "invalid-request")
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT count(*) FROM "{schema}".batch').fetchone() == (0,)
    # a valid pair is one character, and fine
    r = client.post(
        "/v1/batches", content=b'{"user_key": "\\ud83d\\ude00"}', headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 201 and r.json()["user_key"] == "\U0001f600"


@pytest.mark.parametrize("spelled", ["+{id}", "-0", " {id}", "{id} ", "{id}.0", "0{id}", "1_{id}", "\u0661", "{id}e0"])
def test_a_batch_id_that_is_not_a_plain_decimal_names_no_batch(client, spelled):
    batch_id = _open(client)
    path = spelled.format(id=batch_id)
    for method, suffix in (("GET", ""), ("POST", "/close"), ("POST", "/items")):
        r = client.request(method, f"/v1/batches/{path}{suffix}", json={"count": 3} if suffix == "/items" else None)
        assert r.status_code == 400, (path, suffix, r.status_code, r.text)
    status = client.get(f"/v1/batches/{batch_id}").json()
    assert (status["state"], status["total"]) == ("open", 0)  # neither closed nor added to


def test_two_authorization_headers_are_refused(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/v1/batches", json={}, headers=[("Authorization", "Bearer nope-nope-nope-nope"), *AUTH.items()])
        _problem(r, 400, "invalid-request")
        r = c.post("/v1/batches", json={}, headers=[*AUTH.items(), *AUTH.items()])
        _problem(r, 400, "invalid-request")


def _raw_exchange(url: str, payload: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except TimeoutError:
                break
            if not data:
                break  # the server closed the connection
            chunks.append(data)
    return b"".join(chunks)


def test_a_request_framed_two_ways_is_refused_and_what_it_hides_never_runs(server, client):
    before = _open(client)
    body = b'{"user_key": "outer"}'
    smuggled = f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}".encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    request = (
        b"POST /v1/batches HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {TOKEN}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(chunked)}\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + chunked
        + smuggled
    )
    answer = _raw_exchange(server.url, request)
    assert answer.count(b"HTTP/1.1 ") == 1, answer  # one answer, then the connection closed
    assert answer.startswith(b"HTTP/1.1 400") and b"connection: close" in answer.lower()
    assert _open(client) == before + 1  # neither the outer request nor the hidden one opened a batch


def test_invented_methods_do_not_create_metric_series(server, client):
    for method in ("FROBNICATE", "BREW", "X" * 40):
        client.request(method, "/v1/batches")
    metrics = httpx.get(f"{server.url}/metrics").text
    lines = [line for line in metrics.splitlines() if "_http_requests_total{" in line]
    allowed = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "other")
    assert lines and all(any(f'method="{m}"' in line for m in allowed) for line in lines), lines
    assert "FROBNICATE" not in metrics and "BREW" not in metrics


def test_readiness_asks_the_database_once_per_ttl_however_many_callers_ask():
    calls = 0
    now = [0.0]

    async def ping() -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)

    async def main() -> None:
        readiness = Readiness(ping, ttl=1.0, clock=lambda: now[0])
        assert all(await asyncio.gather(*(readiness.check() for _ in range(200))))
        assert calls == 1
        now[0] = 0.5
        assert await readiness.check() and calls == 1
        now[0] = 1.5
        assert await readiness.check() and calls == 2

    asyncio.run(main())


def test_readiness_reports_a_failed_ping_and_asks_again_after_the_ttl():
    state = {"fail": True, "calls": 0}
    now = [0.0]

    async def ping() -> None:
        state["calls"] += 1
        if state["fail"]:
            raise StoreUnavailable("down")

    async def main() -> None:
        readiness = Readiness(ping, ttl=1.0, clock=lambda: now[0])
        assert not await readiness.check()
        state["fail"] = False
        assert not await readiness.check()  # still the known answer
        now[0] = 2.0
        assert await readiness.check() and state["calls"] == 2

    asyncio.run(main())


def test_readyz_through_the_server(server):
    for _ in range(20):
        assert httpx.get(f"{server.url}/readyz").status_code == 200


def test_a_large_ack_is_parsed_and_folded_off_the_event_loop(pg_dsn, schema, monkeypatch):
    """The CPU work of a large request (JSON parsing, folding) runs in a worker thread, never on
    the server's event loop, so one caller cannot hold up the others' requests."""
    import threading

    import harvester.services.http.strict_json as strict_json
    import tracker.aio as aio

    seen: dict[str, list[str]] = {"parse": [], "fold": []}
    real_loads, real_fold = strict_json.loads, aio.fold

    def loads(body, bound=None):
        seen["parse"].append(threading.current_thread().name)
        return real_loads(body, bound)

    def fold(entries):
        seen["fold"].append(threading.current_thread().name)
        return real_fold(entries)

    monkeypatch.setattr(strict_json, "loads", loads)
    monkeypatch.setattr(aio, "fold", fold)
    with (
        RunningServer(http_config(pg_dsn, schema, backend="tracker"), [TOKEN]) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as client,
    ):
        batch_id = _open(client)
        (group,) = client.post(f"/v1/batches/{batch_id}/items", json={"count": 8000}).json()["groups"]
        ids = [f"{batch_id}:{group['group_id']}:{i}" for i in range(8000)]
        r = client.post("/v1/acks", json={"ids": ids})
        assert r.status_code == 200 and r.json()["acked"] == 8000
    loop_thread = server.thread.name
    assert seen["parse"] and seen["fold"]
    assert loop_thread not in seen["parse"][-1:] + seen["fold"][-1:], seen
    # the API's own threads, not the loop's default executor the console or name lookups may hold
    assert seen["parse"][-1].startswith("reaper-http-cpu"), seen


def _silent_until_closed(url: str, send: list[tuple[float, bytes]], limit: float = 20.0) -> float:
    """Send the pieces at their times, then read until the server closes; seconds until it did."""
    import time

    host, port = url.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=limit) as s:
        for at, piece in send:
            time.sleep(max(0.0, started + at - time.monotonic()))
            try:
                s.sendall(piece)
            except OSError:
                break  # already closed
        try:
            while s.recv(65536):
                pass
        except ConnectionResetError:
            pass
    return time.monotonic() - started


@pytest.mark.parametrize(
    "what, pieces",
    [
        ("nothing at all", []),
        (
            "half its headers, a byte every 0.2 s",
            [(0.2 * i, b"GET /healthz HTTP/1.1\r\nHost: x\r\n"[i : i + 1]) for i in range(25)],
        ),
        (
            "half its body",
            [
                (
                    0.0,
                    b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
                )
            ],
        ),
    ],
)
def test_a_slow_client_cannot_hold_a_connection(pg_dsn, schema, what, pieces):
    cfg = http_config(pg_dsn, schema, header_timeout=1.0, body_timeout=1.0)
    with RunningServer(cfg, [TOKEN]) as server:
        took = _silent_until_closed(server.url, pieces)
    # closed by the server (the read would otherwise have waited out its 20 s), trickling or not
    assert took < 15, f"{what}: still open after {took:.1f} s"


def test_open_waits_are_capped_per_token(pg_dsn, schema):
    import threading

    other = "another-token-0123456789"
    cfg = http_config(pg_dsn, schema, max_waits_per_token=2, completion_poll_interval=0.05)
    with (
        RunningServer(cfg, [TOKEN, other]) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client,
    ):
        batch_id = _open(client)
        answers: list[int] = []
        polls = [
            threading.Thread(
                target=lambda: answers.append(client.get(f"/v1/batches/{batch_id}/completion?wait=30").status_code)
            )
            for _ in range(2)
        ]
        for t in polls:
            t.start()
        import time

        from harvester.services.http.security import token_id

        waits = server.app.fastapi.state.waits
        deadline = time.monotonic() + 60
        while waits.held(token_id(TOKEN)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waits.held(token_id(TOKEN)) == 2, "the two long-polls did not start"
        doc = _problem(client.get(f"/v1/batches/{batch_id}/completion?wait=30"), 429, "rate-limited")
        assert doc["limit"] == 2
        # another token has its own count
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other}"}, timeout=60) as c2:
            assert c2.get(f"/v1/batches/{batch_id}/completion?wait=0").status_code == 200
        assert client.post(f"/v1/batches/{batch_id}/close").json()["complete"] is True  # wakes both polls
        for t in polls:
            t.join(30)
        assert answers == [200, 200]
        # released: a new wait is taken again, and a stream that ends releases its place too
        for _ in range(3):
            with client.stream("GET", f"/v1/batches/{batch_id}/events") as r:
                assert r.status_code == 200 and "complete" in r.read().decode()
        assert client.get(f"/v1/batches/{batch_id}/completion?wait=0").status_code == 200


def test_strict_parsing_costs_memory_in_proportion_to_the_body_whatever_its_shape():
    """A field's path is spelled out only for the one reported: a long key over a long list costs
    the body's size, not the key's length times the list's."""
    import json
    import tracemalloc

    from harvester.services.http.strict_json import loads

    for body in (
        json.dumps({"ids": {"k" * 100_000: [0] * 3000}}).encode(),
        json.dumps({"a" * 5000: {"b" * 5000: [[["x"] * 100] * 20] * 5}}).encode(),
    ):
        tracemalloc.start()
        loads(body)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 20 * len(body) + (1 << 20), (len(body), peak)


def test_what_h11_refuses_is_a_problem_document_too(server):
    answer = _raw_exchange(server.url, b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\n\r\n{}")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/problem+json" in head.lower(), answer
    import json

    assert json.loads(body)["type"].endswith(":invalid-request")


def test_a_malformed_header_line_gets_a_problem_document_as_the_openapi_document_describes_it(server):
    import json

    import jsonschema

    served = httpx.get(server.url + "/v1/openapi.json").json()
    schema = {"$ref": "#/components/schemas/ProblemDoc", "components": served["components"]}
    for request in (
        b"GET /v1/batches/1 HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n",
        b"GET /v1/batches/1 HTTP/1.1\r\nHost: x\r\nX-Ok: 1\r\nno colon here either\r\n\r\n",
    ):
        answer = _raw_exchange(server.url, request)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), answer
        doc = json.loads(body)
        jsonschema.validate(doc, schema)  # `instance` among the required members
        assert (doc["type"], doc["field"], doc["instance"]) == (
            "urn:outbox-reaper:problem:invalid-request",
            "headers",
            "",
        )


@pytest.mark.parametrize(
    "path, body, field",
    [
        # JSON (RFC 8259) has no NaN or Infinity; Python's parser takes them, and 1e400 overflows to inf
        ("/v1/batches", b'{"tolerated_failure_ratio": NaN}', "body.tolerated_failure_ratio"),
        ("/v1/batches", b'{"tolerated_failure_ratio": Infinity}', "body.tolerated_failure_ratio"),
        ("/v1/batches", b'{"tolerated_failure_ratio": -Infinity}', "body.tolerated_failure_ratio"),
        ("/v1/batches", b'{"tolerated_failure_ratio": 1e400}', "body.tolerated_failure_ratio"),
        ("/v1/batches", b'{"tolerated_failure_ratio": -1e400}', "body.tolerated_failure_ratio"),
        ("/v1/acks", b'{"ids": ["1:0:0", NaN]}', "body.ids[1]"),
        # an integer past the digits the interpreter converts
        ("/v1/batches", b'{"tolerated_failures": ' + b"9" * 5000 + b"}", "body.tolerated_failures"),
        ("/v1/batches", b'{"parent": -' + b"1" * 4301 + b"}", "body.parent"),
        # arrays nested past the parser's recursion, and past NESTING_MAX within it (a long path is cut)
        ("/v1/batches", b'{"user_key": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
        ("/v1/batches", b"[" * 100_000 + b"]" * 100_000, "body"),
        ("/v1/batches", b'{"user_key": ' + b"[" * 65 + b"]" * 65 + b"}", ("body.user_key" + "[0]" * 63)[:200] + "..."),
    ],
)
def test_numbers_json_has_not_and_nesting_too_deep_are_refused_naming_the_field(
    client, pg_dsn, schema, path, body, field
):
    import psycopg

    r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    doc = _problem(r, 400, "invalid-request")
    assert doc["field"] == field, doc
    assert client.get("/v1/batches/0").status_code == 404  # the connection is still open and answers
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT count(*) FROM "{schema}".batch').fetchone() == (0,)


def test_a_problem_document_never_carries_a_number_json_has_not():
    """Whatever a check puts in a problem, its document can be written: NaN and the infinities as text."""
    import json

    from harvester.services.http import problems

    problem = problems.Problem(
        "invalid-request", "d", field="body.x", value=float("nan"), errors=[{"low": float("-inf")}], high=float("inf")
    )
    doc = json.loads(problems.response(problem, "/v1/batches").body)
    assert (doc["value"], doc["errors"], doc["high"]) == ("nan", [{"low": "-inf"}], "inf")


def test_an_item_id_in_a_path_with_a_nul_is_a_malformed_id_on_both_backends(client):
    for bad in ("1:0:%00", "%001:0:0", "1:0:0-%00", "1:0:x"):
        r = client.post(f"/v1/acks/{bad}")
        assert r.status_code == 400 and r.json()["type"].endswith(":malformed-item-id"), (bad, r.text)


def test_a_client_that_stops_reading_its_responses_is_disconnected(pg_dsn, schema):
    import time

    cfg = http_config(pg_dsn, schema, header_timeout=1.0, body_timeout=1.0)
    with RunningServer(cfg, [TOKEN]) as server:
        host, port = server.url.removeprefix("http://").split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        try:
            s.sendall(b"GET /v1/openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 300)
            time.sleep(4)  # never reading: the server's writes stall past body_timeout
            s.settimeout(10)
            got, closed = b"", False
            while True:
                try:
                    data = s.recv(1 << 20)
                except TimeoutError:
                    break
                if not data:
                    closed = True
                    break
                got += data
        finally:
            s.close()
    assert closed and got.count(b"HTTP/1.1 200") < 300


def test_a_long_poll_whose_client_left_frees_its_place_at_once(pg_dsn, schema):
    import time

    from harvester.services.http.security import token_id

    cfg = http_config(pg_dsn, schema, max_waits_per_token=1)
    with (
        RunningServer(cfg, [TOKEN]) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client,
    ):
        batch_id = _open(client)
        waits = server.app.fastapi.state.waits
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                f"GET /v1/batches/{batch_id}/completion?wait=50 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
            )
            deadline = time.monotonic() + 30
            while waits.held(token_id(TOKEN)) < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert waits.held(token_id(TOKEN)) == 1
        deadline = time.monotonic() + 30  # the client left: its place is freed well before its 50 s
        while waits.held(token_id(TOKEN)) > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert waits.held(token_id(TOKEN)) == 0
        assert client.get(f"/v1/batches/{batch_id}/completion?wait=0").status_code == 200


@pytest.mark.parametrize("spelled", ["01:0:1", "1:00:1", "1:0:01", "1:0:1-02"])
def test_an_item_id_with_a_leading_zero_is_malformed_in_a_body_and_in_a_path(client, spelled):
    """'01' and '1' would be two spellings of one batch: ids are read one way only."""
    batch_id = _open(client)
    client.post(f"/v1/batches/{batch_id}/items", json={"count": 3})
    entry = spelled.replace("1:", f"{batch_id}:", 1) if spelled.startswith("1:") else spelled
    for r in (client.post("/v1/acks", json={"ids": [entry]}), client.post(f"/v1/acks/{entry}")):
        doc = _problem(r, 400, "malformed-item-id")
        assert doc["item_id"] == entry
    assert client.get(f"/v1/batches/{batch_id}").json()["pending"] == 3
