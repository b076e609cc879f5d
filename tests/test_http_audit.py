"""Every write a token makes leaves one audit line (logger reaper.audit) with its final status,
refused or not: a forbidden topic, another tenant's batch, a body the server refuses, a reused
Idempotency-Key, a replay."""

from __future__ import annotations

import structlog.testing
from support.http_server import RunningServer, http_config
from test_http_tenants import BILLING, SEARCH, _client, _write


def test_refused_writes_are_audited_with_their_final_status(pg_dsn, schema, tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    _write(tenants_file, {"billing": ([BILLING], ["billing-done"]), "search": ([SEARCH], None)})
    cfg = http_config(pg_dsn, schema, tenants_file=str(tenants_file), max_ids_per_request=5)
    with RunningServer(cfg, []) as server, _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        theirs = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        billing.post(f"/v1/batches/{theirs}/items", json={"count": 3})
        key = {"Idempotency-Key": '"audit-1"'}
        with structlog.testing.capture_logs() as logs:
            attempts = [
                ("billing", billing.post("/v1/batches", json={"completion_topic": "search-done"})),  # 403
                ("search", search.post(f"/v1/batches/{theirs}/close")),  # 404: another tenant's batch
                ("search", search.post(f"/v1/batches/{theirs}/items", json={"count": 1})),  # 404
                ("search", search.post("/v1/acks", json={"ids": [f"{theirs}:0:0"]})),  # 422
                ("search", search.post("/v1/failures", json={"ids": [f"{theirs}:0:1"], "reason": "x"})),  # 422
                ("billing", billing.post("/v1/acks", json={"ids": ["1:0:0"] * 6})),  # 413: too many ids
                ("billing", billing.post("/v1/batches", json={"nope": 1})),  # 400
                ("billing", billing.post(f"/v1/batches/{theirs}/close", headers=key)),  # 200
                ("billing", billing.post(f"/v1/batches/{theirs}/close", headers=key)),  # 200, replayed
                ("billing", billing.post("/v1/batches", json={"completion_topic": "billing-done"}, headers=key)),  # 422
            ]
            billing.get(f"/v1/batches/{theirs}")  # a read: not audited
    statuses = [r.status_code for _, r in attempts]
    assert statuses == [403, 404, 404, 422, 422, 413, 400, 200, 200, 422], statuses
    audits = [e for e in logs if e.get("event") == "audit"]
    assert [(a["tenant"], a["path"], a["status"]) for a in audits] == [
        (tenant, r.request.url.path, r.status_code) for tenant, r in attempts
    ]
    assert [a["replayed"] for a in audits] == [False] * 8 + [True, False]
    assert [a["outcome"] for a in audits] == ["refused"] * 7 + ["applied", "replayed", "refused"]
    assert audits[0]["problem"] == "forbidden" and audits[7]["problem"] is None
    assert all(a["token"].startswith("tok-") and a["request_id"] for a in audits)
    assert not any(BILLING in str(a) or SEARCH in str(a) for a in audits)
