"""The reaper's inbox maintenance (harvester.services.inbox) on the real Postgres: one pass makes
the partitions ahead and drops expired ones, and sets the inbox's gauges; the inbox section of the
configuration refuses values naming them; the inbox calls count in the tracker's collectors."""

from __future__ import annotations

import datetime
import threading

import psycopg
import pytest
from prometheus_client import CollectorRegistry
from psycopg import sql

from harvester.config import ConfigError, load
from harvester.db_pool import make_pool
from harvester.metrics import get as get_metrics
from harvester.services.inbox import inbox_loop
from tracker.inbox import Inbox
from tracker.inbox import retention as r


def test_one_pass_makes_partitions_drops_expired_ones_and_sets_the_gauges(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        c.execute("CREATE TABLE inbox_old (LIKE inbox INCLUDING DEFAULTS)")
        c.execute("CREATE UNIQUE INDEX ON inbox_old (consumer, message_id)")
        c.execute("ALTER TABLE inbox ATTACH PARTITION inbox_old FOR VALUES FROM ('2020-01-01') TO ('2020-01-02')")
        c.execute("INSERT INTO inbox_partition VALUES ('inbox_old', '2020-01-01', '2020-01-02')")
        c.execute("INSERT INTO inbox VALUES ('c', 'old-id', '2020-01-01 12:00+00')")
        with c.transaction():
            Inbox("c", schema=schema, registry=None).claim(c, "new-id")
    cfg = load(
        environ={},
        overrides={
            "database": {"dsn": pg_dsn, "schema": schema},
            "inbox": {"bucket": 3600, "ahead": 6 * 86400, "retention": 86400},
            "metrics": {"prefix": "inboxtest"},
        },
    )
    stop = threading.Event()
    stop.set()  # one pass, then return
    pool = make_pool(pg_dsn, 1, name="inbox-test")
    try:
        inbox_loop(cfg, pool, stop)
    finally:
        pool.close()
    m = get_metrics("inboxtest")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        parts = r.partitions(c, schema=schema)
    assert "inbox_old" not in {p.name for p in parts}
    assert parts[-1].upper >= datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=6)
    assert m.inbox_partitions_dropped._value.get() >= 1
    assert m.inbox_bytes._value.get() > 0
    assert 0 < m.inbox_oldest_age._value.get() < 2 * 86400  # today's partition holds new-id


@pytest.mark.parametrize(
    "section, named",
    [
        ({"bucket": 10}, "inbox.bucket"),
        ({"retention": 59}, "inbox.retention"),
        ({"bucket": 60, "retention": 61_000}, "inbox.retention"),
        ({"bucket": 60, "retention": 600, "ahead": 61_000}, "inbox.ahead"),
        ({"max_drops": 0}, "inbox.max_drops"),
    ],
)
def test_the_inbox_configuration_names_a_bad_value(section, named):
    with pytest.raises(ConfigError) as err:
        load(environ={}, overrides={"inbox": section})
    assert err.value.key == named and str(list(section.values())[-1]) in str(err.value)


def test_the_inbox_calls_count_processed_and_duplicates(pg_dsn, schema):
    reg = CollectorRegistry()
    box = Inbox("billing", schema=schema, registry=reg, metrics_prefix="acme")
    with psycopg.connect(pg_dsn) as conn:
        box.claim(conn, "a")
        box.run_once(conn, "a", lambda c: None)
        box.run_once(conn, "b", lambda c: None)
        conn.commit()
    labels = {"schema": schema, "consumer": "billing"}
    assert reg.get_sample_value("acme_inbox_processed_total", labels) == 2
    assert reg.get_sample_value("acme_inbox_deduplicated_total", labels) == 1
