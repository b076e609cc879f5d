"""`reaper outbox status` reports every harvest unit of the configuration: each outbox of
harvester.outboxes, each lane of it, read from its own database; one that cannot be read is
named with its error while the others are still reported."""

from __future__ import annotations

import collections
import uuid

import psycopg
from support.harness import insert_rows, make_config
from support.teardown import drop_schema

from harvester.admin import status as status_mod
from harvester.exit_codes import ExitCode
from harvester.publishing.outbox_sql import lane_of
from tracker import schema as schema_mod


def test_status_reports_every_outbox_and_lane(pg_dsn, kafka_bootstrap, schema, topics):
    other = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, other)
    try:
        cfg = make_config(
            pg_dsn,
            schema,
            kafka_bootstrap,
            leader_topic=topics("leader", partitions=4),
            harvester={
                "outboxes": [
                    {"name": "laned", "schema": schema, "lanes": 3},
                    {"name": "plain", "schema": other},
                ]
            },
        )
        rows = [(b"key-%d" % i, b"v%d" % i) for i in range(60)]
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, "t", rows)
            insert_rows(conn, other, "t", rows[:7])
            conn.execute(
                f'INSERT INTO "{schema}".outbox_dead (id, created_at, topic, key, value, header_keys, header_values, leader_id, reason) '
                "VALUES (-1, now(), 't', 'key-1', 'x', '{}', '{}', gen_random_uuid(), 'test')"
            )
            conn.commit()
            st = status_mod.outbox_status(cfg, conn, timeout=5)
        per_lane = collections.Counter(lane_of(k, 3) for k, _ in rows)
        got = {u.name: (u.unit, u.table, u.lane, u.lanes, u.backlog_rows, u.dead_rows) for u in st.units}
        assert got == {
            "laned.0": (0, f"{schema}.outbox", 0, 3, per_lane[0], int(lane_of(b"key-1", 3) == 0)),
            "laned.1": (1, f"{schema}.outbox", 1, 3, per_lane[1], int(lane_of(b"key-1", 3) == 1)),
            "laned.2": (2, f"{schema}.outbox", 2, 3, per_lane[2], int(lane_of(b"key-1", 3) == 2)),
            "plain": (3, f"{other}.outbox", 0, 1, 7, 0),
        }, got
        text = status_mod.render(st)
        assert "unit 1 (laned.1)" in text and "lane 1 of 3" in text and "unit 3 (plain)" in text, text
    finally:
        drop_schema(pg_dsn, other, if_exists=False)


def test_an_outbox_whose_database_cannot_be_read_is_named_and_the_others_still_reported(
    pg_dsn, kafka_bootstrap, schema, topics
):
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=topics("leader", partitions=2),
        harvester={
            "outboxes": [
                {"name": "here", "schema": schema},
                {"name": "gone", "dsn": "postgresql://postgres@127.0.0.1:1/outbox"},
            ]
        },
    )
    with psycopg.connect(pg_dsn) as conn:
        st = status_mod.outbox_status(cfg, conn, timeout=5)
    here, gone = st.units
    assert (here.name, here.error, gone.name) == ("here", None, "gone")
    assert gone.error and "127.0.0.1" in gone.error, gone
    assert status_mod.exit_code(st) == ExitCode.UNAVAILABLE
    assert "unit 1 (gone)" in status_mod.render(st) and "unreadable" in status_mod.render(st)
