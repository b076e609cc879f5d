"""Harvest units: lanes and several outboxes, leaders spread by Kafka, one unit's stall holds no other."""

from __future__ import annotations

import collections
import time
import uuid

import psycopg
import pytest
from support.harness import Receiver, insert_rows, make_config, order_violations, outbox_count, wait_until
from support.teardown import drop_schema

from harvester import config as config_mod
from harvester.election.group_bounds import SessionTimeoutRefused, broker_session_bounds, check_session_timeout
from harvester.election.leader_topic import LeaderTopicMismatch
from harvester.metrics import get as get_metrics
from harvester.publishing.outbox_sql import FOREVER, lane_of
from harvester.units import Harvester
from tracker import schema as schema_mod


def _unit_published(unit: str) -> float:
    return get_metrics().unit_published.labels(unit)._value.get()


def _rows(n: int, keys: int, tag: bytes = b"") -> list[tuple[bytes, bytes]]:
    seq = collections.Counter()
    out = []
    for i in range(n):
        k = b"key-%d" % (i % keys)
        out.append((k, k + b":" + tag + b"%d" % seq[k]))
        seq[k] += 1
    return out


@pytest.mark.parametrize("lanes", [2, 5])
def test_a_lane_mark_walks_the_primary_key_and_never_scans_the_whole_table(pg_dsn, schema, topics, lanes):
    """With a backlog the planner misjudges `lane(key) = n` (it guesses 0.5% of rows) and would
    scan and sort the whole table on every mark; the mark must walk the primary key in id order."""
    from harvester.publishing.outbox_sql import OutboxStore, make_pool

    topic = topics("data", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(b"key-%d" % (i % 500), b"v" * 50) for i in range(30_000)])
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'ANALYZE "{schema}".outbox')
    pool = make_pool(pg_dsn, 1)

    def scans() -> tuple[int, int]:
        with pool.connection() as conn:  # the only connection: the mark's own backend
            conn.execute("SELECT pg_stat_force_next_flush()")  # flushed when this statement ends
        with pool.connection() as conn:
            got = conn.execute(
                "SELECT seq_scan, idx_scan FROM pg_stat_user_tables WHERE relid = %s::regclass",
                [f'"{schema}".outbox'],
            ).fetchone()
        assert got is not None
        return got

    try:
        before = scans()
        me = uuid.uuid4()
        for lane in range(lanes):
            rows = OutboxStore(pool, schema, lane=lane, lanes=lanes).mark(me, 200, until=FOREVER)
            assert len(rows) == 200 and {lane_of(r[2], lanes) for r in rows} == {lane}
        after = scans()
        assert after[0] == before[0], f"{after[0] - before[0]} sequential scans of the outbox for {lanes} marks"
        assert after[1] - before[1] >= lanes
        with pool.connection() as conn:  # the pinned plan lasted the mark's transaction, no longer
            assert conn.execute("SHOW enable_seqscan").fetchone() == ("on",)
            assert conn.execute("SHOW max_parallel_workers_per_gather").fetchone() != ("0",)
    finally:
        pool.close()


@pytest.mark.parametrize("lanes", [1, 3])
def test_lane_of_agrees_with_the_mark_query(pg_dsn, schema, topics, lanes):
    """Every row is marked by exactly the lane lane_of(key) names (null keys: lane 0)."""
    from harvester.publishing.outbox_sql import OutboxStore, make_pool

    topic = topics("data", partitions=1)
    keys = [None, b"", b"k", b"\x00\xff"] + [b"key-%d" % i for i in range(60)]
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, topic, [(k, b"v") for k in keys])
    pool = make_pool(pg_dsn, 1)
    try:
        marked = {}
        for lane in range(lanes):
            rows = OutboxStore(pool, schema, lane=lane, lanes=lanes).mark(uuid.uuid4(), 1000, until=FOREVER)
            for r in rows:
                assert r[2] not in marked, f"key {r[2]!r} marked by lanes {marked[r[2]]} and {lane}"
                marked[r[2]] = lane
        assert marked == {k: lane_of(k, lanes) for k in keys}
    finally:
        pool.close()


def test_two_lanes_spread_over_two_reapers_keep_order_and_lose_nothing(pg_dsn, kafka_bootstrap, schema, topics):
    topic, leader = topics("data", partitions=3), topics("leader", partitions=2)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester={"lanes": 2})
    receiver = Receiver(kafka_bootstrap, topic, 3)
    a = Harvester(cfg).start()
    b = None
    try:
        assert wait_until(lambda: a.leading_units() == ["default.0", "default.1"], 30), a.leading_units()
        b = Harvester(cfg).start()
        # cooperative-sticky moves one unit to the newcomer: one unit each
        assert wait_until(lambda: len(a.leading_units()) == 1 and len(b.leading_units()) == 1, 30), (
            a.leading_units(),
            b.leading_units(),
        )
        assert set(a.leading_units()) | set(b.leading_units()) == {"default.0", "default.1"}
        before = {u: _unit_published(u) for u in ("default.0", "default.1")}
        rows = _rows(3000, keys=40)
        with psycopg.connect(pg_dsn) as conn:
            for i in range(0, len(rows), 100):
                insert_rows(conn, schema, topic, rows[i : i + 100])
        assert receiver.wait_for(set(rows), 60)
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
        time.sleep(0.5)
        assert order_violations([(k, v) for k, v, _ in receiver.records]) == []
        per_lane = collections.Counter(lane_of(k, 2) for k, _ in rows)
        published = {u: _unit_published(u) - before[u] for u in before}
        # each unit published its own lane's rows (duplicates only after a failure: none here)
        assert published == {"default.0": per_lane[0], "default.1": per_lane[1]}, (published, per_lane)
    finally:
        if b is not None:
            b.stop(5)
        a.stop(5)
        receiver.close()


def test_a_stalled_outbox_holds_up_no_other_unit(pg_dsn, kafka_bootstrap, schema, topics):
    """Two outboxes led by one reaper: while one table is locked (its marks hang, as with a dead
    database), the other's rows are published."""
    other = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, other)
    topic, leader = topics("data", partitions=1), topics("leader", partitions=2)
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=leader,
        harvester={"outboxes": [{"name": "stuck", "schema": other}, {"name": "free", "schema": schema}]},
    )
    receiver = Receiver(kafka_bootstrap, topic, 1)
    h = Harvester(cfg).start()
    locker = psycopg.connect(pg_dsn)
    try:
        assert wait_until(lambda: sorted(h.leading_units()) == ["free", "stuck"], 30), h.leading_units()
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, other, topic, [(b"s", b"s:0")])
        assert receiver.wait_for({(b"s", b"s:0")}, 30)
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, other, topic, [(b"s", b"s:1")])
        time.sleep(0.5)  # (published or not: the lock below may catch its purge)
        locker.execute(f'LOCK TABLE "{other}".outbox IN ACCESS EXCLUSIVE MODE')  # held until rollback
        time.sleep(0.5)  # the stuck unit's next mark now waits for the lock
        rows = [(b"f", b"f:%d" % i) for i in range(200)]
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, topic, rows)
        assert receiver.wait_for(set(rows), 20), "the free outbox waited for the stuck one"
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 20)
        locker.rollback()
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, other, topic, [(b"s", b"s:2")])
        assert receiver.wait_for({(b"s", b"s:2")}, 30), "the stuck outbox did not resume"
    finally:
        locker.close()
        h.stop(5)
        receiver.close()
        drop_schema(pg_dsn, other)


def test_a_leader_topic_that_disagrees_with_the_units_is_refused(pg_dsn, kafka_bootstrap, schema, topics):
    leader = topics("leader", partitions=1)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester={"lanes": 2})
    h = Harvester(cfg)
    with pytest.raises(LeaderTopicMismatch, match="1 partition.*2 harvest unit"):
        h.start()
    h.stop(1)


def test_a_session_timeout_the_brokers_refuse_is_refused_at_start_naming_both(kafka_bootstrap):
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    bounds = broker_session_bounds(admin, 10.0)
    assert bounds, "the brokers' group session timeout bounds could not be read"
    low = max(lo for lo, _ in bounds.values())
    high = min(hi for _, hi in bounds.values())
    for accepted in (low, high, (low + high) // 2):
        check_session_timeout(admin, accepted, 10.0)
    for refused in (low - 1, high + 1):
        with pytest.raises(
            SessionTimeoutRefused, match=rf"harvester.session_timeout {refused / 1000:g} s.*{low / 1000:g} s"
        ):
            check_session_timeout(admin, refused, 10.0)


def test_a_harvester_whose_leader_group_could_never_form_does_not_start(pg_dsn, kafka_bootstrap, schema, topics):
    from confluent_kafka.admin import AdminClient

    low = max(lo for lo, _ in broker_session_bounds(AdminClient({"bootstrap.servers": kafka_bootstrap}), 10.0).values())
    seconds = (low - 100) / 1000
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=topics("leader", partitions=1),
        harvester={"session_timeout": seconds, "heartbeat_timeout": seconds / 2},
    )
    h = Harvester(cfg)
    with pytest.raises(SessionTimeoutRefused, match="group.min.session.timeout.ms"):
        h.start()
    h.stop(1)


def test_units_configuration_is_validated_naming_the_key():
    def load(**harvester):
        return config_mod.load(None, environ={}, overrides={"harvester": harvester})

    assert [u.name for u in config_mod.units(load(lanes=3))] == ["default.0", "default.1", "default.2"]
    cfg = load(outboxes=[{"name": "a", "schema": "s1", "lanes": 2}, {"name": "b", "table": "outbox2"}])
    assert [(u.index, u.name, u.schema, u.table, u.lane, u.lanes) for u in config_mod.units(cfg)] == [
        (0, "a.0", "s1", "outbox", 0, 2),
        (1, "a.1", "s1", "outbox", 1, 2),
        (2, "b", "reaper", "outbox2", 0, 1),
    ]
    for bad, key in [
        ({"lanes": 0}, "harvester.lanes"),
        ({"lanes": 65}, "harvester.lanes"),
        ({"outboxes": [{"name": "a"}, {"name": "a"}]}, "harvester.outboxes[1].name"),
        ({"outboxes": [{"name": "a", "schema": 'x"; drop'}]}, "harvester.outboxes[0].schema"),
        ({"outboxes": [{"name": "a", "lanes": "2"}]}, "harvester.outboxes[0].lanes"),
        ({"outboxes": [{"nme": "a"}]}, "harvester.outboxes[0].nme"),
        ({"outboxes": ["a"]}, "harvester.outboxes[0]"),
        ({"outboxes": [{"name": "a"}], "lanes": 2}, "harvester.lanes"),
    ]:
        with pytest.raises(config_mod.ConfigError) as err:
            load(**bad)
        assert err.value.key == key, (bad, err.value)
