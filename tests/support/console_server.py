"""The console's test server: a configuration with a tenants file, a viewer token, an ack topic
and its dead-letter topic; the running HTTP service; clients logged in with a token."""

from __future__ import annotations

import httpx
import psycopg
import pytest

from harvester.services.http.tenants import new_token
from support.console import login
from support.harness import make_config
from support.http_server import TOKEN, RunningServer

VIEWER = "viewer-token-0123456789abcdef"


@pytest.fixture
def cfg(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    tenant_token, digest = new_token()
    tenants = tmp_path / "tenants.yml"
    tenants.write_text(f"tenants:\n  billing:\n    tokens: ['{digest}']\n")
    c = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=topics("leader"),
        http={"tenants_file": str(tenants), "completion_poll_interval": 0.05},
        acker={"topic": topics("acks"), "dead_letter_topic": topics("acks-dead")},
        console={"viewer_tokens": VIEWER, "page_size": 3, "refresh_interval": 0.5, "kafka_timeout": 5},
    )
    c.tenant_token = tenant_token  # type: ignore[attr-defined]
    return c


@pytest.fixture
def server(cfg):
    with RunningServer(cfg, [TOKEN]) as s:
        yield s


@pytest.fixture
def viewer(server):
    return client(server, VIEWER)


def client(server, token: str | None = None) -> httpx.Client:
    c = httpx.Client(base_url=server.url, timeout=60)
    if token is not None:
        r = login(c, token)
        assert r.status_code == 303, r.text
    return c


def state_of(pg_dsn: str, schema: str, batch_id: int) -> str:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT state FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()[0]
