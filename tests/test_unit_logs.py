"""Each log line of a harvest unit carries its own unit's name and leader id, never another
unit's, with several units led by one process (the ids were process-wide)."""

from __future__ import annotations

import collections

import psycopg
from support.harness import Receiver, insert_rows, make_config, outbox_count, wait_until
from support.json_log import events, json_log

from harvester.units import Harvester

LANES = 3
MARKING = ("leading: marking from the head", "force remark")


def test_every_line_of_a_unit_carries_its_own_leader_id(pg_dsn, kafka_bootstrap, schema, topics):
    topic = topics("data", partitions=3)
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=topics("leader", partitions=LANES),
        harvester={"lanes": LANES, "mark_batch": 50},
    )
    receiver = Receiver(kafka_bootstrap, topic, 3)
    with json_log() as out:
        h = Harvester(cfg).start()
        try:
            assert wait_until(lambda: len(h.leading_units()) == LANES, 30), h.leading_units()
            rows = [(b"key-%d" % (i % 50), b"v%d" % i) for i in range(3000)]
            with psycopg.connect(pg_dsn) as conn:
                for i in range(0, len(rows), 100):
                    insert_rows(conn, schema, topic, rows[i : i + 100])
            assert receiver.wait_for(set(rows), 60)
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
            h.force_remark("a test: every unit takes a new id")
            wait_until(lambda: False, 1)
        finally:
            h.stop(5)
            receiver.close()
        logged = events(out)
    names = {f"default.{lane}" for lane in range(LANES)}
    ids = collections.defaultdict(set)  # unit -> the marking ids it announced
    for e in logged:
        if e["event"] in MARKING and e.get("unit") in names:
            ids[e["unit"]].add(e["leader_id"])
    assert set(ids) == names, ids
    assert all(ids[a].isdisjoint(ids[b]) for a in names for b in names if a != b), ids
    unit_lines = [e for e in logged if e.get("unit") in names]
    # lines of a unit's own threads (publisher, purge workers, poll) carry the unit too
    assert {e["event"] for e in unit_lines} - set(MARKING), unit_lines
    wrong = [e for e in unit_lines if e.get("leader_id") is not None and e["leader_id"] not in ids[e["unit"]]]
    assert wrong == [], wrong[:5]
    # a line of no unit names no unit's id when several units run
    assert all(e.get("leader_id") is None for e in logged if "unit" not in e), [e for e in logged if "unit" not in e]
