"""`reaper run`'s backlog gauges cover every outbox of the configuration (harvester.outboxes, each
from its own database), not only the `database` section's; one whose database is away is logged
and the others are still counted."""

from __future__ import annotations

import threading
import uuid

import psycopg
from prometheus_client import CollectorRegistry
from support.harness import insert_rows, make_config
from support.teardown import drop_schema

from harvester import logs
from harvester.db_pool import make_pool
from harvester.gauges import OutboxGauges, _outboxes
from harvester.metrics import HarvesterMetrics
from tracker import schema as schema_mod


def test_the_backlog_gauges_count_every_outbox(pg_dsn, kafka_bootstrap, schema, topics):
    other = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, other)
    pool = make_pool(pg_dsn, 1, name="test-gauges")
    pools: dict = {}
    try:
        cfg = make_config(
            pg_dsn,
            schema,
            kafka_bootstrap,
            leader_topic=topics("leader", partitions=4),
            harvester={
                "outboxes": [
                    {"name": "laned", "schema": schema, "lanes": 2},
                    {"name": "plain", "schema": other},
                    {"name": "away", "dsn": "postgresql://postgres@127.0.0.1:1/outbox"},
                ]
            },
        )
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, "t", [(b"k%d" % i, b"v") for i in range(5)])
            insert_rows(conn, other, "t", [(b"k%d" % i, b"v") for i in range(7)])
            conn.execute(
                f'INSERT INTO "{other}".outbox_dead (id, created_at, topic, key, value, header_keys, header_values, '
                "leader_id, reason) VALUES (-1, now() - interval '1 hour', 't', 'k', 'x', '{}', '{}', "
                "gen_random_uuid(), 'test')"
            )
            conn.commit()
        m = HarvesterMetrics("gauges", CollectorRegistry())
        gauges = OutboxGauges(m, _outboxes(cfg, pool, pools), logs.get("test"))
        assert [o.name for o in gauges.outboxes] == ["laned", "plain", "away"]  # one per table, not per lane
        gauges.refresh()
        assert m.backlog_rows._value.get() == 12
        assert m.dead_rows._value.get() == 1
        assert m.oldest_age._value.get() >= 0
        assert set(gauges.latest) == {"laned", "plain"}
    finally:
        for p in pools.values():
            threading.Thread(target=p.close, daemon=True).start()  # the one that never connected
        pool.close()
        drop_schema(pg_dsn, other, if_exists=False)


def test_the_dead_rows_gauge_stops_counting_at_its_cap(pg_dsn, kafka_bootstrap, schema, monkeypatch):
    """An incident that quarantines a great many rows must not make every refresh scan them all."""
    import harvester.gauges

    monkeypatch.setattr(harvester.gauges, "DEAD_COUNTED", 11)
    pool = make_pool(pg_dsn, 1, name="test-gauges-dead")
    try:
        cfg = make_config(pg_dsn, schema, kafka_bootstrap)
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                f'INSERT INTO "{schema}".outbox_dead (id, created_at, topic, key, value, header_keys, header_values, '
                "leader_id, reason) SELECT -g, now(), 't', 'k', 'x', '{}', '{}', gen_random_uuid(), 'test' "
                "FROM generate_series(1, %s) g",
                [n := 20],
            )
            conn.commit()
        m = HarvesterMetrics("gauges", CollectorRegistry())
        gauges = OutboxGauges(m, _outboxes(cfg, pool, {}), logs.get("test"))
        gauges.refresh()
        assert n > 11 and m.dead_rows._value.get() == 11
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'DELETE FROM "{schema}".outbox_dead WHERE id < -5')
        gauges.refresh()
        assert m.dead_rows._value.get() == 5
    finally:
        pool.close()
