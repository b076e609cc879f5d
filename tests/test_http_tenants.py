"""Tenants through a real server on both backends: another tenant's batch is indistinguishable from
one that does not exist, completion topics are allowed per tenant, tokens are stored as hashes and
added or revoked without a restart, and every write leaves an audit line naming its tenant."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import psycopg
import pytest
import structlog
from psycopg import sql
from support.http_server import RunningServer, http_config

from harvester.config import ConfigError
from harvester.services.http.tenants import TenantAuth, parse

BILLING = "billing-token-0123456789abcdef"
SEARCH = "search-token-0123456789abcdef"
LATER = "later-token-0123456789abcdef"


def _hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def _write(path: Path, tenants: dict[str, tuple[list[str], list[str] | None]]) -> None:
    lines = ["tenants:"]
    for name, (tokens, topics) in tenants.items():
        lines.append(f"  {name}:")
        lines.append(f"    tokens: [{', '.join(repr(_hash(t)) for t in tokens)}]")
        if topics is not None:
            lines.append(f"    completion_topics: [{', '.join(topics)}]")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(params=["tracker", "sql"])
def servers(request, pg_dsn, schema, tmp_path):
    tenants_file = tmp_path / "tenants.yaml"
    _write(tenants_file, {"billing": ([BILLING], ["billing-done"]), "search": ([SEARCH], None)})
    cfg = http_config(pg_dsn, schema, backend=request.param, tenants_file=str(tenants_file))
    with RunningServer(cfg, []) as server:
        yield server, tenants_file


def _client(server, token: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def _state(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return (
            c.execute(
                sql.SQL("SELECT id, state, total, pending, tenant FROM {} ORDER BY id").format(
                    sql.Identifier(schema, "batch")
                )
            ).fetchall(),
            c.execute(
                sql.SQL("SELECT batch_id, id, bits::text FROM {} ORDER BY 1, 2").format(
                    sql.Identifier(schema, "batch_group")
                )
            ).fetchall(),
        )


def test_another_tenants_batch_is_indistinguishable_from_one_that_does_not_exist(servers, pg_dsn, schema):
    server, _ = servers
    with _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        r = billing.post("/v1/batches", json={"completion_topic": "billing-done", "user_key": "secret"})
        batch_id = r.json()["batch_id"]
        (group,) = billing.post(f"/v1/batches/{batch_id}/items", json={"count": 3}).json()["groups"]
        absent = batch_id + 1000
        before = _state(pg_dsn, schema)
        for theirs, nobodys in (
            (search.get(f"/v1/batches/{batch_id}"), search.get(f"/v1/batches/{absent}")),
            (
                search.post(f"/v1/batches/{batch_id}/items", json={"count": 1}),
                search.post(f"/v1/batches/{absent}/items", json={"count": 1}),
            ),
            (search.post(f"/v1/batches/{batch_id}/close"), search.post(f"/v1/batches/{absent}/close")),
            (
                search.get(f"/v1/batches/{batch_id}/completion?wait=0"),
                search.get(f"/v1/batches/{absent}/completion?wait=0"),
            ),
            # (a short read timeout: were the stream served, the test would fail here, not hang)
            (search.get(f"/v1/batches/{batch_id}/events", timeout=5), search.get(f"/v1/batches/{absent}/events")),
            (
                search.post("/v1/acks", json={"ids": [f"{batch_id}:{group['group_id']}:0"]}),
                search.post("/v1/acks", json={"ids": [f"{absent}:0:0"]}),
            ),
        ):
            assert theirs.status_code == nobodys.status_code and theirs.status_code in (404, 422), theirs.text
            mask = lambda d: {k: v for k, v in d.items() if k not in ("detail", "batch_id", "item_id", "instance")}
            assert mask(theirs.json()) == mask(nobodys.json())
            assert "secret" not in theirs.text
        # a mixed ack is refused whole: nothing of it is applied, nothing counted for the owner
        mixed = search.post("/v1/acks", json={"ids": [f"{batch_id}:{group['group_id']}:1"]})
        assert mixed.status_code == 422
        assert _state(pg_dsn, schema) == before
        # the owner still sees and completes it
        assert (
            billing.post("/v1/acks", json={"ids": [f"{batch_id}:{group['group_id']}:{i}" for i in range(3)]}).json()[
                "acked"
            ]
            == 3
        )
        assert billing.post(f"/v1/batches/{batch_id}/close").json()["complete"] is True


def test_completion_topics_are_allowed_per_tenant(servers):
    server, _ = servers
    with _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        assert billing.post("/v1/batches", json={"completion_topic": "billing-done"}).status_code == 201
        refused = billing.post("/v1/batches", json={"completion_topic": "payments-internal"})
        assert refused.status_code == 403 and refused.json()["type"].endswith(":forbidden")
        assert billing.post("/v1/batches", json={}).status_code == 403  # the default topic is not in its list
        assert search.post("/v1/batches", json={}).status_code == 201  # no list: the server's default topic only
        assert search.post("/v1/batches", json={"completion_topic": "elsewhere"}).status_code == 403


def test_tokens_are_added_and_revoked_without_a_restart(servers):
    server, tenants_file = servers
    with _client(server, LATER) as later, _client(server, SEARCH) as search:
        assert later.get("/v1/batches/1").status_code == 401
        _write(tenants_file, {"billing": ([BILLING, LATER], ["billing-done"])})  # LATER added, SEARCH revoked
        deadline = time.monotonic() + 10
        while later.get("/v1/batches/1").status_code == 401 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert later.get("/v1/batches/1").status_code == 404  # known now (and the batch does not exist)
        assert search.get("/v1/batches/1").status_code == 401
        tenants_file.write_text("tenants: [not, a, mapping]\n")  # a broken file keeps what was loaded
        time.sleep(1.2)
        assert later.get("/v1/batches/1").status_code == 404


def test_every_write_leaves_an_audit_line_naming_its_tenant(servers):
    server, _ = servers
    with structlog.testing.capture_logs() as logs, _client(server, BILLING) as billing:
        batch_id = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        billing.post(f"/v1/batches/{batch_id}/close")
    audits = [e for e in logs if e.get("event") == "audit"]
    assert [(a["tenant"], a["method"], a["path"], a["status"]) for a in audits] == [
        ("billing", "POST", "/v1/batches", 201),
        ("billing", "POST", f"/v1/batches/{batch_id}/close", 200),
    ]
    assert all(a["token"].startswith("tok-") and BILLING not in str(a) for a in audits)


def test_the_tenants_file_holds_hashes_only_and_names_what_is_wrong():
    with pytest.raises(ConfigError, match="sha256"):
        parse("tenants:\n  a:\n    tokens: ['plain-token-in-clear']\n", "batch-completions")
    with pytest.raises(ConfigError, match="default"):
        parse("tenants:\n  default:\n    tokens: []\n", "batch-completions")
    callers = parse(f"tenants:\n  a:\n    tokens: ['{_hash(BILLING)}']\n", "done")
    assert [(c.tenant.name, c.tenant.completion_topics) for _, c in callers] == [("a", frozenset({"done"}))]
    auth = TenantAuth([], "", "done")
    assert auth.identify(None) is not None  # no tokens at all: local mode, the default tenant


def test_an_ack_answers_the_same_whether_or_not_another_tenants_batch_exists(servers):
    """The entries are checked first and the batches in the tracker's order: an ack naming another
    tenant's batch gets the answer it would get if that batch had never been opened."""
    server, _ = servers
    with _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        theirs = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        billing.post(f"/v1/batches/{theirs}/items", json={"count": 3})
        mine = search.post("/v1/batches", json={}).json()["batch_id"]
        search.post(f"/v1/batches/{mine}/items", json={"count": 3})
        absent = theirs + 1000
        for template in (
            ["zz", "{b}:0:0"],  # a malformed entry first: named, whatever follows
            ["{absent}:0:0", "{b}:0:0"],  # an absent batch first: named first
            ["{mine}:0:01", "{b}:0:0"],  # a malformed own entry first
            ["{mine}:0:0", "{b}:0:0"],  # own entries, then the other tenant's batch
        ):

            def ack(b: int) -> httpx.Response:
                ids = [t.format(b=b, absent=absent, mine=mine) for t in template]
                return search.post("/v1/acks", json={"ids": ids})

            a, b = ack(theirs), ack(absent + 1)
            strip = lambda r: {
                k: v for k, v in r.json().items() if k not in ("detail", "batch_id", "item_id", "instance")
            }
            assert (a.status_code, strip(a)) == (b.status_code, strip(b)), (template, a.text, b.text)

            # and the same entry is named: the other tenant's batch where the absent one would be
            def entry(r: httpx.Response, stand_in: int) -> tuple[str, str]:
                head, _, rest = str(r.json().get("item_id")).partition(":")
                return ("B" if head == str(stand_in) else head), rest

            assert entry(a, theirs) == entry(b, absent + 1), (a.text, b.text)


def test_the_reapers_own_topics_are_no_completion_topic_for_anyone(servers):
    server, _ = servers
    with _client(server, SEARCH) as search:
        for topic in ("acks", "acks-dead-letter", "__reaper_leader"):
            r = search.post("/v1/batches", json={"completion_topic": topic})
            assert r.status_code == 403 and r.json()["type"].endswith(":forbidden"), r.text


def test_another_tenants_batch_cannot_be_failed_read_or_parented(servers, pg_dsn, schema):
    """Failures follow the ack rule, their page and a child's parent the status rule: another
    tenant's batch answers exactly as one that does not exist, and nothing changes."""
    server, _ = servers
    with _client(server, BILLING) as billing, _client(server, SEARCH) as search:
        theirs = billing.post("/v1/batches", json={"completion_topic": "billing-done"}).json()["batch_id"]
        billing.post(f"/v1/batches/{theirs}/items", json={"count": 3})
        billing.post("/v1/failures", json={"ids": [f"{theirs}:0:0"], "reason": "billing secret"})
        absent = theirs + 1000
        before = _state(pg_dsn, schema)
        for a, b in (
            (
                search.post("/v1/failures", json={"ids": [f"{theirs}:0:1"], "reason": "r"}),
                search.post("/v1/failures", json={"ids": [f"{absent}:0:1"], "reason": "r"}),
            ),
            (search.get(f"/v1/batches/{theirs}/failures"), search.get(f"/v1/batches/{absent}/failures")),
            (search.post("/v1/batches", json={"parent": theirs}), search.post("/v1/batches", json={"parent": absent})),
        ):
            assert a.status_code == b.status_code and a.status_code in (404, 422), a.text
            mask = lambda d: {k: v for k, v in d.items() if k not in ("detail", "batch_id", "item_id", "instance")}
            assert mask(a.json()) == mask(b.json())
            assert "billing secret" not in a.text
        assert _state(pg_dsn, schema) == before
        page = billing.get(f"/v1/batches/{theirs}/failures").json()  # the owner reads its own
        assert page["failures"] == [{"item_id": f"{theirs}:0:0", "reason": "billing secret"}]
        child = billing.post("/v1/batches", json={"completion_topic": "billing-done", "parent": theirs})
        assert child.status_code == 201 and child.json()["parent_id"] == theirs


@pytest.mark.parametrize(
    "content",
    [b"tenants: \xff\n", b"tenants: 2001-13-45\n", b"a: &x [*x]\n", b"tenants:\n  a: {tokens: [1e400]}\n"],
)
def test_a_tenants_file_spoiled_while_serving_keeps_the_tenants_that_were(servers, content):
    """Edited into bytes that are not UTF-8, a YAML value no loader reads, an alias: re-read on
    change, it is refused with an error line, the server keeps serving with the tenants it had (a
    request still gets its answer, never a 500), and a file fixed again is read again."""
    server, tenants_file = servers
    with _client(server, BILLING) as billing:
        assert billing.get("/v1/batches/1").status_code == 404
        tenants_file.write_bytes(content)
        time.sleep(1.1)  # the file is looked at no more than once a second
        for _ in range(3):
            assert billing.get("/v1/batches/1").status_code == 404  # still billing's token
            time.sleep(0.4)
        _write(tenants_file, {"billing": ([BILLING], ["billing-done"]), "search": ([SEARCH, LATER], None)})
        time.sleep(1.1)
        with _client(server, LATER) as later:
            assert later.get("/v1/batches/1").status_code == 404  # the fixed file was read


def test_tokens_and_tenants_files_that_are_not_utf8_are_named_at_start(tmp_path):
    from harvester.config import HttpConfig
    from harvester.services.http.security import load_tokens

    bad = tmp_path / "bad"
    bad.write_bytes(b"\xfftoken-0123456789abcdef\n")
    with pytest.raises(ConfigError, match="http.tenants_file.*not UTF-8"):
        TenantAuth([], str(bad), "done")
    with pytest.raises(ConfigError, match="http.tokens_file.*not UTF-8"):
        load_tokens(HttpConfig(tokens_file=str(bad)))
    big = tmp_path / "big"
    big.write_bytes(b"#" * (4 << 20) + b"\n")
    with pytest.raises(ConfigError, match="larger than"):
        TenantAuth([], str(big), "done")


def test_a_tenant_written_twice_or_an_alias_is_refused_naming_the_line():
    with pytest.raises(ConfigError, match="found key 'billing' twice"):
        parse(
            f"tenants:\n  billing:\n    tokens: ['{_hash(BILLING)}']\n  billing:\n    tokens: ['{_hash(LATER)}']\n",
            "done",
        )
    with pytest.raises(ConfigError, match="alias"):
        parse(f"tokens: &t ['{_hash(BILLING)}']\ntenants:\n  billing:\n    tokens: *t\n", "done")
