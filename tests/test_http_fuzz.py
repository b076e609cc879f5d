"""Schemathesis: the service's own OpenAPI document, fuzzed against a real server and Postgres.

Every operation of the document the server serves at /v1/openapi.json gets schemathesis's coverage
cases (boundaries, missing and mistyped fields, unexpected methods) and a few dozen random requests,
valid and invalid, on both backends. Every response must be documented (status code, media type
and, where the document gives one, the body's schema), none may be a 5xx, every error must be an
RFC 9457 problem document, and no body may show a stack trace or SQL.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from support.http_server import TOKEN, RunningServer, http_config

from harvester.services.http import openapi

AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Random requests per operation and backend (the fuzzing phase; the coverage phase adds its own
# fixed cases): 10 operations x 2 backends take some 25 s on two cores.
MAX_EXAMPLES = 40
# What must never reach a client: a Python traceback, a driver's name, SQL.
LEAKS = re.compile(r'Traceback|File "|psycopg|asyncpg|sqlalchemy|SELECT |INSERT |UPDATE |DELETE FROM|pg_catalog')

CONFIG = schemathesis.Config.from_dict(
    {
        "generation": {
            "mode": "all",  # valid and invalid requests
            "max-examples": MAX_EXAMPLES,
            "with-security-parameters": False,  # the bearer token is always ours (AUTH)
            "database": "none",  # nothing replayed from or kept in .hypothesis/ (the seed is new each run)
        },
        "phases": {"examples": {"enabled": False}, "stateful": {"enabled": False}},  # no examples, no links
        "headers": AUTH,
        "output": {"sanitization": {"enabled": False}},  # a failure shows the exact request (a test token)
        "request-timeout": 5,
        # GET /v1/batches/{batch_id}/events streams until the batch completes or expires, with a
        # keep-alive comment every 15 s. Schemathesis reads a text/event-stream answer until this
        # many events (or the request timeout) and hangs up: the first event, the status now, is
        # what there is to check, and the server frees the stream's place when the client goes.
        # The completion long-poll is bounded by the server: long_poll_max=1 (below) refuses a
        # longer `wait` with a 400, so no request waits more than a second.
        "max-stream-events": 1,
    }
)

# The document the server serves at /v1/openapi.json (the `server` fixture checks that it does).
# Loading it from each test's running server (schemathesis.pytest.from_fixture) fails on pytest
# 9.2, which no longer has the `Function._nodeid` that schemathesis 4.32 sets; the same document
# built in-process, parametrized at import, does not.
DOCUMENT = openapi.document()
fuzzed = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)

# What the running test's server holds (`_seed`): batches in each state and item ids in them.
SEEDED: dict[str, list] = {"batches": [], "ids": []}
# A few valid keys (a quoted string, as the parameter's description says), so that requests reuse
# them: with the same request (the stored answer comes back) or with another one (refused).
IDEMPOTENCY_KEYS = ['"fuzz-1"', '"fuzz-2"', '"fuzz-3"']


def _seed(c: httpx.Client) -> tuple[list[int], list[str]]:
    batches, ids = [], []
    for items, close, ack in ((0, False, False), (3, False, False), (3, True, False), (2, True, True), (4, True, None)):
        opened = {"user_key": "fuzz", **({"tolerated_failures": 1, "parent": batches[0]} if ack is None else {})}
        b = c.post("/v1/batches", json=opened).json()["batch_id"]
        batches.append(b)
        mine = []
        if items:
            for g in c.post(f"/v1/batches/{b}/items", json={"count": items}).json()["groups"]:
                mine += [f"{b}:{g['group_id']}:{i}" for i in range(g["start"], g["upto"])]
                mine.append(f"{b}:{g['group_id']}:{g['start']}-{g['upto'] - 1}")  # a run
        if close:
            c.post(f"/v1/batches/{b}/close").raise_for_status()
        if ack:
            c.post("/v1/acks", json={"ids": mine}).raise_for_status()
        if ack is None:  # a child of the first batch, finished failed by a threshold: failures to page through
            c.post("/v1/failures", json={"ids": mine[:2], "reason": "fuzz"}).raise_for_status()
        ids += mine
    return batches, ids


# Random ids are almost never ones the server knows: half the time, these hooks put in real ones.


@fuzzed.hook
def flatmap_path_parameters(ctx, path_parameters):
    if not isinstance(path_parameters, dict) or not SEEDED["batches"]:
        return st.just(path_parameters)
    if "batch_id" in path_parameters:
        real = st.sampled_from(SEEDED["batches"]).map(lambda b: {**path_parameters, "batch_id": b})
    elif "item_id" in path_parameters:
        real = st.sampled_from(SEEDED["ids"]).map(lambda i: {**path_parameters, "item_id": i})
    else:
        return st.just(path_parameters)
    return st.one_of(st.just(path_parameters), real)


@fuzzed.hook
def flatmap_body(ctx, body):
    if ctx.operation.path not in ("/v1/acks", "/v1/failures") or not isinstance(body, dict) or not SEEDED["ids"]:
        return st.just(body)
    extra = {"reason": body.get("reason", "fuzz")} if ctx.operation.path == "/v1/failures" else {}
    real = st.lists(st.sampled_from(SEEDED["ids"]), max_size=8).map(lambda i: {"ids": i, **extra})
    return st.one_of(st.just(body), real)


@fuzzed.hook
def flatmap_headers(ctx, headers):
    if headers is not None and not isinstance(headers, dict):
        return st.just(headers)
    if not any(p.name == "Idempotency-Key" for p in ctx.operation.headers):
        return st.just(headers)
    keyed = st.sampled_from(IDEMPOTENCY_KEYS).map(lambda k: {**(headers or {}), "Idempotency-Key": k})
    return st.one_of(st.just(headers), keyed)


@pytest.fixture(params=["tracker", "sql"])
def server(request, pg_dsn, schema):
    cfg = http_config(pg_dsn, schema, backend=request.param, rate_limit=0, long_poll_max=1)
    with RunningServer(cfg, [TOKEN]) as s:
        with httpx.Client(base_url=s.url, headers=AUTH, timeout=30) as c:
            assert c.get("/v1/openapi.json").json() == DOCUMENT
            SEEDED["batches"], SEEDED["ids"] = _seed(c)
        try:
            yield s
        finally:
            SEEDED["batches"], SEEDED["ids"] = [], []


def _sent_text(case) -> list[str]:
    """Every string the request carried, as the server may echo it back (in a detail, a user_key)."""
    out: list[str] = []

    def walk(value: object) -> None:
        if isinstance(value, str) and value:
            out.extend({value, json.dumps(value)[1:-1], repr(value)[1:-1]})
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k)
                walk(v)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v)

    for part in (case.path_parameters, case.query, case.headers, case.body):
        walk(part)
    return sorted(out, key=len, reverse=True)


def problem_document(ctx, response, case) -> None:
    """An error is an RFC 9457 problem document: application/problem+json with type, title, status, detail."""
    if response.status_code < 400:
        return
    ctype = (response.headers.get("content-type") or [""])[0]
    assert ctype.split(";")[0].strip() == "application/problem+json", f"a {response.status_code} as {ctype!r}"
    doc = json.loads(response.content)
    assert isinstance(doc, dict), f"a {response.status_code} whose body is not an object: {doc!r}"
    for key, kind in (("type", str), ("title", str), ("status", int), ("detail", str)):
        assert isinstance(doc.get(key), kind), f"a problem document without a {kind.__name__} {key!r}: {doc}"
    assert doc["status"] == response.status_code, f"a {response.status_code} whose document says otherwise: {doc}"


def no_leaked_internals(ctx, response, case) -> None:
    """No stack trace, driver name or SQL in a body, other than in what the request itself sent."""
    text = response.content.decode("utf-8", "replace")
    for sent in _sent_text(case):
        text = text.replace(sent, "")
    leak = LEAKS.search(text)
    assert leak is None, f"the body shows {leak.group()!r}: {response.content[:500]!r}"


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    problem_document,
    no_leaked_internals,
]


@fuzzed.parametrize()
# One server and schema per operation and backend, shared by that operation's requests (hence the
# function-scoped fixture): what one request leaves (a batch opened, closed, completed, an
# Idempotency-Key used) is what a later one runs into, as on a live server.
@settings(
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ]
)
def test_every_operation_answers_as_documented(case, server):
    response = case.call(base_url=server.url, headers=AUTH)
    case.validate_response(response, checks=CHECKS, headers=AUTH)
