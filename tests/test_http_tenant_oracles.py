"""Another tenant's batch leaks nothing through an error's text: what a caller reads of the
problem for another tenant's batch, the batch id written as the id it named, is exactly what it
reads for a batch that was never opened. Through a real server on both backends."""

from __future__ import annotations

import httpx
import psycopg
import pytest
from psycopg import sql
from support.http_server import RunningServer, http_config
from test_http_tenants import BILLING, SEARCH, _client, _write

from tracker.expiry import expire_batch


@pytest.fixture(params=["tracker", "sql"])
def server(request, pg_dsn, schema, tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    _write(tenants_file, {"billing": ([BILLING], ["billing-done"]), "search": ([SEARCH], None)})
    cfg = http_config(pg_dsn, schema, backend=request.param, tenants_file=str(tenants_file))
    with RunningServer(cfg, []) as s:
        yield s


def _seen(r: httpx.Response, batch_id: int) -> tuple[int, dict]:
    """The whole answer, the batch id it names written as B (the caller knows the id it sent)."""
    doc = {k: v for k, v in r.json().items() if k != "instance"}
    assert doc.pop("batch_id", batch_id) == batch_id
    text = repr(sorted(doc.items())).replace(f"'{batch_id}:", "'B:").replace(f"batch {batch_id}", "batch B")
    return r.status_code, {"doc": text}


def test_a_parent_of_another_tenant_reads_exactly_as_one_never_opened(server):
    with _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        theirs = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        absent = theirs + 1000
        a = search.post("/v1/batches", json={"parent": theirs})
        b = search.post("/v1/batches", json={"parent": absent})
        assert a.status_code == 422, a.text
        assert _seen(a, theirs) == _seen(b, absent), (a.text, b.text)


def test_an_expired_batch_of_another_tenant_reads_exactly_as_one_never_opened(server, pg_dsn, schema):
    with _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        theirs = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        billing.post(f"/v1/batches/{theirs}/items", json={"count": 3})
        with psycopg.connect(pg_dsn) as c:
            expire_batch(c, theirs, schema=schema)
            c.commit()
        absent = theirs + 1000
        for route, body in (("/v1/failures", {"reason": "r"}), ("/v1/acks", {})):
            a = search.post(route, json={"ids": [f"{theirs}:0:1"], **body})
            b = search.post(route, json={"ids": [f"{absent}:0:1"], **body})
            assert _seen(a, theirs) == _seen(b, absent), (route, a.text, b.text)
        # the owner is told its batch expired
        r = billing.post("/v1/failures", json={"ids": [f"{theirs}:0:1"], "reason": "r"})
        assert r.status_code == 410, r.text
        with psycopg.connect(pg_dsn) as c:
            (failed,) = c.execute(
                sql.SQL("SELECT failed FROM {} WHERE id = %s").format(sql.Identifier(schema, "batch")), [theirs]
            ).fetchone()
        assert failed == 0
