"""The rows of a partition run whose report failed for one record alone: the run is reset whole
and its rows published again with a report each (DeliverySettler.single), so the record Kafka
refuses is quarantined with its reason; a row that never comes back is forgotten after
`alone_for`. Real Kafka and Postgres where records are produced."""

from __future__ import annotations

import time
import uuid

import psycopg
from hypothesis import given, settings
from hypothesis import strategies as st
from support.harness import outbox_marks
from test_harvester_runs import FOREVER_VALID, P, _insert, _publisher_parts, _Recording, _stop

from harvester.publishing.outbox_sql import FOREVER


def test_a_record_kafka_never_accepts_in_a_run_is_quarantined_with_its_reason(pg_dsn, kafka_bootstrap, schema, topics):
    """Explicit partition 7 of a 2-partition topic, produced before the producer knows the topic:
    produce() takes it and its run's report fails with _UNKNOWN_PARTITION. The run is reset whole,
    and its rows, published again with a report each, are quarantined with that reason."""
    topic = topics("data", partitions=2)
    ids = _insert(pg_dsn, schema, [(topic, b"a", 0), (topic, b"b", 7), (topic, b"c", 7), (topic, b"d", 0)])
    pool, store, settler, slot, plain, remarks = _publisher_parts(pg_dsn, schema, kafka_bootstrap)
    try:
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == 4
        assert settler.drain(30)
        assert outbox_marks(pg_dsn, schema) == {ids[1]: None, ids[2]: None}
        assert set(settler.single) == {ids[1], ids[2]} and settler.dead_rows == 0
        again = uuid.uuid4()
        rows = store.mark(again, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, again, *FOREVER_VALID) == 2
        assert settler.drain(30)
        assert outbox_marks(pg_dsn, schema) == {}
        assert settler.dead_rows == 2 and not settler.single
        with psycopg.connect(pg_dsn) as c:
            dead = c.execute(f'SELECT id, reason FROM "{schema}".outbox_dead ORDER BY id').fetchall()
        assert [d[0] for d in dead] == ids[1:3] and all(d[1].startswith("_UNKNOWN_PARTITION") for d in dead), dead
    finally:
        _stop(pool, settler, slot)


def test_rows_of_a_refused_run_that_never_come_back_are_forgotten(pg_dsn, kafka_bootstrap, schema, topics):
    """The rows of a refused run are remembered to be published with a report each; when they
    never come back to this process (here deleted, as once another leader has published them) they
    are forgotten after `alone_for`, and the next call plans its rows by runs again."""
    topic = topics("data", partitions=2)
    ids = _insert(pg_dsn, schema, [(topic, b"a", 0), (topic, b"b", 7)])
    pool, store, settler, slot, plain, remarks = _publisher_parts(pg_dsn, schema, kafka_bootstrap)
    try:
        settler.alone_for = 0.5
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == 2
        assert settler.drain(30)
        assert set(settler.single) == {ids[1]}
        with psycopg.connect(pg_dsn) as c:
            c.execute(f'DELETE FROM "{schema}".outbox WHERE id = %s', [ids[1]])
        time.sleep(0.6)
        fresh = _insert(pg_dsn, schema, [(topic, b"k%d" % i, None) for i in range(20)])
        me = uuid.uuid4()
        rows = store.mark(me, 100, until=FOREVER)
        settler.reserve(len(rows))
        assert plain.produce_rows(rows, me, *FOREVER_VALID) == len(fresh)
        assert settler.drain(30)
        assert not settler.single, "a row that never came back is still remembered"
        assert outbox_marks(pg_dsn, schema) == {} and settler.dead_rows == 0
    finally:
        _stop(pool, settler, slot)


def test_a_row_to_report_alone_leaves_the_set_when_published_unplaced():
    """A row of a refused run is published next with a report of its own, placed or not (its
    topic's partition count unknown meanwhile): either way it leaves `single`, which must empty
    again for the one-topic fast path of plan_runs to be taken."""
    from harvester.publishing.runs import UNPLACED, PartitionCounts, plan_runs

    producer = _Recording(set(), 0, "")
    single = dict.fromkeys([1, 2], time.monotonic() + 60)
    rows = [(1, "missing", b"k", b"v", [], [], None, f"{P}1"), (2, "t1", None, b"v", [], [], None, f"{P}2")]
    parts, runs, _last = plan_runs(rows, PartitionCounts(), producer, single)
    assert parts == [UNPLACED, UNPLACED] and runs == [-1, -1]
    assert single == {}


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["add", "plan", "wait"]), st.lists(st.integers(1, 30), max_size=6)),
        max_size=40,
    )
)
def test_remembered_rows_are_kept_exactly_until_planned_or_expired(events):
    """Against a model: a row id stays while it was remembered less than ALONE_FOR ago and not
    planned since; planned (its row published with a report of its own), or expired, it leaves."""
    from harvester.publishing.runs import ALONE_FOR, UNPLACED, PartitionCounts, forget_expired, plan_runs

    now = 0.0
    single: dict[int, float] = {}
    model: dict[int, float] = {}
    for kind, ids in events:
        if kind == "add":
            single.update(dict.fromkeys(ids, now + ALONE_FOR))  # as DeliverySettler.report_run
            model.update(dict.fromkeys(ids, now + ALONE_FOR))
        elif kind == "wait":
            now += ALONE_FOR * len(ids) / 4
            forget_expired(single, now)
            model = {k: v for k, v in model.items() if v > now}
        else:
            rows = [(i, "t", None, b"v", [], [], None, f"{P}{i}") for i in ids]  # unplaced: alone
            forget_expired(single, now)
            model = {k: v for k, v in model.items() if v > now}
            parts, runs, _ = plan_runs(rows, PartitionCounts(), _Recording(set(), 0, ""), single)
            assert set(parts) <= {UNPLACED} and set(runs) <= {-1}
            for i in ids:
                model.pop(i, None)
        assert single == model
