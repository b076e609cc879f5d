"""The mark against its leadership: a mark that reaches the server after the lease it was checked
under, or finishes after it, marks nothing; the database clock that maps the lease's deadline
onto the server's; a revocation that waits for a mark on its way; a mark that waits on a lock."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from zoneinfo import ZoneInfo

import psycopg
import pytest
from support.harness import insert_rows, make_config, outbox_count, outbox_marks, wait_until

from harvester.metrics import get as get_metrics
from harvester.publishing.outbox_sql import FOREVER, MarkRefused, OutboxStore, lane_of, make_pool


class _PausedBeforeMark:
    """The outbox store, with the first mark held back `pause` seconds between the marker's lease
    check and the statement reaching the server: a SIGSTOP or VM pause landing just there."""

    def __init__(self, store, pause: float) -> None:
        self._store, self._pause = store, pause
        self.results: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def mark(self, leader_id, limit, *args, **kw):
        if not self.results:
            time.sleep(self._pause)
        try:
            rows = self._store.mark(leader_id, limit, *args, **kw)
        except MarkRefused:
            self.results.append("refused")
            raise
        self.results.append(len(rows))
        return rows


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_mark_sent_after_the_lease_ended_marks_nothing(pg_dsn, kafka_bootstrap, schema, topics, lanes):
    """The server itself refuses a mark that reaches it after the leadership it was checked under
    ended: a leader paused between its lease check and its mark takes no row from its successor."""
    from harvester.config import units
    from harvester.election.lease import Lease
    from harvester.publishing.mark_purge_reset import UnitHarvester
    from harvester.publishing.ports import Providers

    data = topics("data", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, data, [(b"k%d" % i, b"v%d" % i) for i in range(40)])
    in_lane = sum(1 for i in range(40) if lane_of(b"k%d" % i, lanes) == 0)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"lanes": lanes})
    spec = units(cfg)[0]  # lane 0 of `lanes`: the rows of its keys
    paused: list[_PausedBeforeMark] = []

    def wrap(store):
        paused.append(_PausedBeforeMark(store, pause=2.0))
        return paused[-1]

    unit = UnitHarvester(cfg, spec, providers=Providers(store=wrap, description="paused before mark"))
    lease = Lease(0, hb_timeout=1.0, metrics=get_metrics(), on_change=lambda s, lid: None)
    unit.start(lease)
    # Acquired once the unit runs (its start opens a pool: on a loaded machine that could outlast
    # the lease, and the marker would never check it): leads for 1 s, no heartbeat will come.
    lease.acquire()
    try:
        assert wait_until(lambda: paused and paused[0].results, 10), "the marker never marked"
        assert paused[0].results[0] == "refused", "a mark sent after the lease ended was not refused"
        with psycopg.connect(pg_dsn) as conn:
            marked = conn.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE leader_id IS NOT NULL').fetchone()[0]
        assert marked == 0
        assert outbox_count(pg_dsn, schema) == 40
        lease.hb_timeout = 60.0  # heartbeats are back: the same marker leads again, from the head
        lease.last_heartbeat = time.monotonic()
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 40 - in_lane, 30), "the marker did not resume"
    finally:
        unit.finish(2)
        unit.close()


@pytest.mark.parametrize("max_age", [0.0, 1.0])
def test_the_database_clock_maps_a_deadline_early_never_late(pg_dsn, schema, max_age):
    """A monotonic time mapped onto the server's clock is never later than the server's own reading
    of that moment (so a mark's deadline can only err towards refusing), and off by about a round trip."""
    from harvester.election.db_clock import DatabaseClock

    pool = make_pool(pg_dsn, 1)
    try:
        store = OutboxStore(pool, schema)
        trips: list[float] = []  # every read of the server's clock, the anchor's included

        def timed_now():
            sent = time.monotonic()
            try:
                return store.database_now()
            finally:
                trips.append(time.monotonic() - sent)

        clock = DatabaseClock(timed_now, max_age=max_age)
        for _ in range(50):
            started = time.monotonic()
            mapped = clock.at(started)
            server = timed_now()
            spent = time.monotonic() - started
            assert mapped <= server
            # off by what this iteration took and at most one round trip of the anchor's read
            # (a few ms on a quiet machine; measured, not assumed, on a loaded one)
            assert (server - mapped).total_seconds() <= spent + max(trips) + 0.01
    finally:
        pool.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_mark_that_finishes_after_its_deadline_is_taken_back(pg_dsn, schema, topics, lanes):
    """A mark that reached the server in time but waited on a row lock past its deadline marks
    nothing: the check after it, in the same implicit transaction, takes it back."""
    from harvester.election.db_clock import DatabaseClock
    from harvester.publishing.outbox_sql import MarkRefused

    data = topics("data", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, data, [(b"k%d" % i, b"v%d" % i) for i in range(20)])
    pool = make_pool(pg_dsn, 2)
    holder = psycopg.connect(pg_dsn)
    try:
        store = OutboxStore(pool, schema, lane=lane_of(b"k0", lanes), lanes=lanes)
        clock = DatabaseClock(store.database_now)
        holder.execute(f'SELECT id FROM "{schema}".outbox ORDER BY id LIMIT 1 FOR UPDATE')  # k0's row
        outcome: list[object] = []

        def mark() -> None:
            try:
                outcome.append(store.mark(uuid.uuid4(), 20, until=clock.at(time.monotonic() + 0.5)))
            except MarkRefused as exc:
                outcome.append(exc)

        marker = threading.Thread(target=mark)
        marker.start()
        time.sleep(1.5)
        holder.rollback()  # the lock goes 1 s after the deadline: the mark finishes then
        marker.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], MarkRefused), outcome
        with psycopg.connect(pg_dsn) as conn:
            marked = conn.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE leader_id IS NOT NULL').fetchone()[0]
        assert marked == 0
        # In time, the same mark goes through.
        assert store.mark(uuid.uuid4(), 20, until=clock.at(time.monotonic() + 5))
    finally:
        holder.close()
        pool.close()


@pytest.mark.parametrize(
    "server_now",
    [
        # Half a second before New York's clocks go back (EDT), and inside the repeated hour (EST).
        datetime(2026, 11, 1, 1, 59, 59, 500000, tzinfo=ZoneInfo("America/New_York")),
        datetime(2026, 11, 1, 1, 30, tzinfo=ZoneInfo("America/New_York"), fold=1),
        datetime(2026, 3, 8, 1, 59, 59, 500000, tzinfo=ZoneInfo("America/New_York")),
    ],
    ids=["before-fall-back", "repeated-hour", "before-spring-forward"],
)
def test_the_database_clock_counts_in_elapsed_time_across_a_daylight_saving_change(server_now):
    """A server whose TimeZone has daylight saving returns zoned times; a deadline five seconds on
    is five elapsed seconds on, not five seconds on the local wall clock (an hour off across a change)."""
    from harvester.election.db_clock import DatabaseClock

    clock = DatabaseClock(lambda: server_now)
    clock.refresh()
    local = time.monotonic()
    mapped = clock.at(local + 5.0)
    # In UTC: Python subtracts two datetimes of one tzinfo by their wall clocks, shift or not.
    elapsed = (mapped.astimezone(UTC) - server_now.astimezone(UTC)).total_seconds()
    assert 4.999 < elapsed < 5.1, elapsed  # and not 3,605 or 1,795


def test_a_revocation_lets_the_unit_go_only_once_no_mark_is_on_its_way(kafka_bootstrap):
    """A mark checked its lease just before a rebalance took the unit away: the revocation callback
    (after which the group hands the partition on) returns only once that mark has returned, or once
    the database can no longer accept it (its deadline), and no mark starts after it. A lost
    partition (already handed on by the group) is not held back beyond a short bound."""
    from confluent_kafka import Consumer, TopicPartition

    from harvester.election.neli import FOLLOWER, Neli

    neli = Neli(
        bootstrap=kafka_bootstrap,
        client={},
        consumer={},
        producer={},
        topic="not-used",
        group=f"g-{uuid.uuid4().hex[:8]}",
        min_poll_interval=0.1,
        heartbeat_timeout=4.0,
        session_timeout=10.0,
        metrics=get_metrics(),
        units=2,
    )
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"g-{uuid.uuid4().hex[:8]}"})
    neli._consumer = consumer  # the callback acts only for its current consumer

    def marking(unit: int, hold: float) -> tuple[threading.Thread, threading.Event, float]:
        """A mark on its way for `hold` seconds; returns its thread, its end, and the deadline after
        which the database refuses it."""
        lease = neli.lease(unit)
        lease.holding = True
        lease.acquire()
        entered, released = threading.Event(), threading.Event()

        def mark() -> None:
            with lease.marking() as leader_id:
                assert leader_id is not None
                entered.set()
                time.sleep(hold)
            released.set()

        thread = threading.Thread(target=mark, daemon=True)
        thread.start()
        assert entered.wait(5)
        return thread, released, lease.marks_accepted_until()

    try:
        # A short mark, one longer than the first bound (heartbeat_timeout / 4), one that outlasts
        # its deadline: the partition goes once the mark is back, or once it is past its deadline.
        for hold in (0.5, 2.0, 30.0):
            thread, released, deadline = marking(0, hold)
            neli._on_revoke(consumer, [TopicPartition("not-used", 0)])
            returned = time.monotonic()
            assert neli.lease(0).state == FOLLOWER
            assert released.is_set() or returned >= deadline, (hold, returned, deadline)
            with neli.lease(0).marking() as leader_id:
                assert leader_id is None  # nothing starts after the revocation
            if hold < 30:
                thread.join(5)
        # Two units revoked at once, each with a mark longer than the first bound: both are waited for.
        marks = [marking(unit, 2.0) for unit in (0, 1)]
        neli._on_revoke(consumer, [TopicPartition("not-used", 0), TopicPartition("not-used", 1)])
        assert all(released.is_set() for _, released, _ in marks)
        assert neli.lease(0).state == neli.lease(1).state == FOLLOWER
        # Lost (the group already gave the partition away): waiting would protect nothing, and the
        # other units' heartbeats wait for this thread, so only the short bound applies.
        thread, released, deadline = marking(0, 30.0)
        neli._on_lost(consumer, [TopicPartition("not-used", 0)])
        assert time.monotonic() < deadline and not released.is_set()
        assert neli.lease(0).state == FOLLOWER
    finally:
        consumer.close()


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_mark_waiting_on_a_lock_takes_only_its_snapshot_rows_still_unmarked_by_it(pg_dsn, schema, conn, lanes):
    """The mark's rows are its own snapshot's: a row committed meanwhile inside the id range it walks
    (an id taken before the rows above it) is left for the next mark, and a row taken by its own id
    while the mark waited on its lock is neither marked again nor returned (the row-level re-check)."""
    key = b"k"  # one key: with two lanes every row is in the lane of this key
    lane = lane_of(key, lanes)
    insert_rows(conn, schema, "t", [(key, b"a%d" % i) for i in range(3)])
    before = sorted(outbox_marks(pg_dsn, schema))
    me = uuid.uuid4()
    late = psycopg.connect(pg_dsn)
    pool = make_pool(pg_dsn, 1)
    try:
        late_id = late.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id', ["t", key, b"late"]
        ).fetchone()[0]
        late.execute(f'UPDATE "{schema}".outbox SET value = %s WHERE id = %s', [b"changed", before[1]])
        late.execute(f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = %s', [me, before[2]])
        insert_rows(conn, schema, "t", [(key, b"b%d" % i) for i in range(3)])
        after = sorted(set(outbox_marks(pg_dsn, schema)) - set(before))
        assert late_id < after[0]
        store = OutboxStore(pool, schema, lane=lane, lanes=lanes)
        got: list = []
        marking = threading.Thread(target=lambda: got.append(store.mark(me, 100, until=FOREVER)))
        marking.start()
        watch = psycopg.connect(pg_dsn, autocommit=True)
        waiting = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%%SET leader_id%%' "
            "AND position(%s in query) > 0"
        )
        try:
            assert wait_until(lambda: watch.execute(waiting, [f'"{schema}"']).fetchone()[0] > 0, 10), (
                "the mark never waited on the row lock"
            )
        finally:
            watch.close()
        late.commit()
        marking.join(10)
        assert [r[0] for r in got[0]] == [before[0], before[1], *after]
        rows = outbox_marks(pg_dsn, schema)
        assert rows[late_id] is None and rows[before[2]] == me
        assert [r[0] for r in store.mark(me, 100, until=FOREVER)] == [late_id]
    finally:
        late.close()
        pool.close()
