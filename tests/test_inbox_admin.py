"""`reaper inbox show` and `reaper inbox status` against the real Postgres, as operators run them:
text and --json, exit codes, a bad argument refused naming it."""

from __future__ import annotations

import psycopg
import pytest
from support.harness import make_config
from test_admin import as_json, reaper

from harvester.exit_codes import ExitCode
from tracker.inbox import Inbox


@pytest.fixture
def cfg(pg_dsn, kafka_bootstrap, schema, topics):
    return make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"))


def test_inbox_show_names_the_consumers_that_processed_an_id(cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        Inbox("billing", schema=schema, registry=None).claim(conn, "order-7")
        Inbox("shipping", schema=schema, registry=None).claim(conn, "order-7")
        conn.commit()
    r = reaper(cfg, "inbox", "show", "order-7")
    assert r.returncode == ExitCode.OK, r.stderr
    assert "billing" in r.stdout and "shipping" in r.stdout and "inbox_p" in r.stdout
    doc = as_json(reaper(cfg, "inbox", "show", "order-7", "--consumer", "shipping", "--json"))
    assert [x["consumer"] for x in doc["recorded"]] == ["shipping"]
    r = reaper(cfg, "inbox", "show", "order-8", "--json")
    assert r.returncode == ExitCode.NOT_FOUND and as_json(r)["recorded"] == []
    r = reaper(cfg, "inbox", "show", "x" * 201)
    assert r.returncode == ExitCode.USAGE and "longer than 200" in r.stderr


def test_inbox_status_lists_the_partitions(cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        Inbox("billing", schema=schema, registry=None).claim(conn, "order-7")
        conn.commit()
    doc = as_json(reaper(cfg, "inbox", "status", "--json"))
    assert len(doc["partitions"]) >= 4 and doc["oldest_holding"] is not None
    assert any(p["holds_ids"] for p in doc["partitions"])
    r = reaper(cfg, "inbox", "status")
    assert r.returncode == ExitCode.OK and "covered until" in r.stdout
