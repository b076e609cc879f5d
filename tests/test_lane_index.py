"""The lane index (harvester.lane_index): built concurrently, rebuilt when a build was interrupted,
used by the mark only while valid, and the mark through it takes exactly the rows the mark along the
primary key takes."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.harness import insert_rows, lanes_config, limited_role, outbox_count, wait_until

from harvester.lane_index import (
    BUILDING,
    INVALID,
    MAX_IDENTIFIER,
    MISSING,
    RECHECK_VALID,
    VALID,
    LaneIndex,
    LaneIndexKeeper,
    lane_index_name,
)
from harvester.logs import get as get_log
from harvester.publishing.outbox_sql import FOREVER, LANE_MARK_PLAN, LANE_SQL, OutboxStore, lane_of, make_pool
from harvester.units import Harvester


def _build(pg_dsn: str, index: LaneIndex) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for _ in range(3):
            if index.build_step(conn) == VALID:
                return
        assert index.state(conn) == VALID


@given(
    table=st.from_regex(r"[a-z_][a-z0-9_]{0,62}", fullmatch=True),
    lanes=st.integers(2, 1024),
    other=st.integers(2, 1024),
)
def test_index_names_fit_postgres_and_differ_by_lane_count(table, lanes, other):
    name = lane_index_name(table, lanes)
    assert len(name.encode()) <= MAX_IDENTIFIER
    assert name.endswith(f"_lanes{lanes}")
    if other != lanes:
        assert lane_index_name(table, other) != name


def test_a_lane_index_is_for_several_lanes():
    with pytest.raises(ValueError, match="lanes 1"):
        LaneIndex("s", "outbox", 1)


keys = st.one_of(st.none(), st.binary(max_size=12), st.sampled_from([b"a", b"b", b"key-1", b"key-2", b""]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(keys, st.integers(0, 3)), min_size=1, max_size=60),
    lanes=st.integers(2, 5),
    limit=st.integers(1, 40),
)
def test_the_mark_through_the_index_takes_the_rows_the_primary_key_walk_takes(pg_dsn, schema, rows, lanes, limit):
    """Rows with null, empty and arbitrary keys, some already marked by other ids (0 = unmarked):
    for every lane, both marks pick the same ids, in the same order, and those are the lowest
    unmarked-by-me ids of the lane (as lane_of computes it in Python)."""
    index = LaneIndex(schema, "outbox", lanes)
    me = uuid.uuid4()
    marked_by = [None, me, uuid.uuid4(), uuid.uuid4()]  # unmarked, by me (passed over), by others
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'TRUNCATE "{schema}".outbox')
        with conn.cursor() as cur:
            cur.executemany(
                f'INSERT INTO "{schema}".outbox (topic, key, value, leader_id) VALUES (%s, %s, %s, %s)',
                [("t", key, b"v", marked_by[who]) for key, who in rows],
            )
        ids = [r[0] for r in conn.execute(f'SELECT id FROM "{schema}".outbox ORDER BY id')]
        _build(pg_dsn, index)
    pool = make_pool(pg_dsn, 1)
    try:
        for lane in range(lanes):
            expected = [
                i
                for i, (key, who) in zip(ids, rows, strict=True)
                if lane_of(key, lanes) == lane and marked_by[who] != me
            ][:limit]
            store = OutboxStore(pool, schema, lane=lane, lanes=lanes)
            got = {}
            for indexed in (False, True):
                store.use_lane_index(indexed)
                got[indexed] = [r[0] for r in store.mark(me, limit, until=FOREVER)]
                with pool.connection() as conn:  # as it was, for the other mark
                    for i, (_, who) in zip(ids, rows, strict=True):
                        if i in got[indexed]:
                            conn.execute(
                                f'UPDATE "{schema}".outbox SET leader_id = %s WHERE id = %s', [marked_by[who], i]
                            )
            assert got[False] == got[True] == expected
    finally:
        pool.close()


def test_the_indexed_mark_reads_the_lane_index(pg_dsn, schema, topics):
    lanes = 4
    data = topics("data", partitions=1)
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, data, [(b"key-%d" % (i % 500), b"v") for i in range(20_000)])
    index = LaneIndex(schema, "outbox", lanes)
    _build(pg_dsn, index)
    store = OutboxStore(None, schema, lane=1, lanes=lanes)  # type: ignore[arg-type]  # SQL only
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(f'ANALYZE "{schema}".outbox')
        conn.execute(LANE_MARK_PLAN)
        params = {"me": uuid.uuid4(), "n": 500, "until": psycopg.sql.SQL("now() + interval '1 h'")}
        plans = {}
        for name, statement in (("pkey", store._mark), ("indexed", store._mark_indexed)):
            text = statement.as_string(conn)
            text = text.replace("%(me)s", "%(me)s::uuid").replace("%(until)s", "now() + interval '1 h'")
            text = text.replace("%(mid_cut)s", "'-infinity'::timestamptz")  # the message id's (tracker.message_ids)
            bound = {"me": params["me"], "n": 500, "mid_prefix": "ns:"}
            plans[name] = "\n".join(r[0] for r in conn.execute("EXPLAIN " + text, bound))
        conn.rollback()
    assert index.name in plans["indexed"], plans["indexed"]
    assert index.name not in plans["pkey"], plans["pkey"]


def test_an_interrupted_build_is_dropped_and_built_again(pg_dsn, schema):
    """A failed CONCURRENTLY build leaves an invalid index under the name: the next steps drop it,
    then build the real one."""
    index = LaneIndex(schema, "outbox", 2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO \"{schema}\".outbox (topic, key, value) VALUES ('t', 'k', 'v'), ('t', 'k', 'v')")
        lane = LANE_SQL.format(lanes=2)  # a build of the lane expression that fails half way
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(f'CREATE UNIQUE INDEX CONCURRENTLY "{index.name}" ON "{schema}".outbox (({lane}))')
        assert index.state(conn) == INVALID
        assert index.build_step(conn) == INVALID  # dropped
        assert index.state(conn) == MISSING
        assert index.build_step(conn) == MISSING  # built
        assert index.state(conn) == VALID
        definition = conn.execute("SELECT pg_get_indexdef(%s::regclass)", [f'"{schema}"."{index.name}"']).fetchone()[0]
    assert "md5" in definition and "id" in definition


def test_a_reaper_that_may_not_build_it_says_so_backs_off_and_marks_without_it(pg_dsn, schema):
    with limited_role(pg_dsn, schema, "noowner", "SELECT, UPDATE, DELETE") as dsn:
        used: list[bool] = []
        keeper = LaneIndexKeeper(LaneIndex(schema, "outbox", 2), dsn, True, used.append, get_log("test"))
        waits = [keeper.step(), keeper.step()]
        assert used == [False, False] and keeper.failures == 2 and waits[1] > waits[0], waits
        assert "CREATE INDEX CONCURRENTLY" in keeper.index.statement()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_harvester_in_lanes_builds_the_index_and_marks_through_it(pg_dsn, kafka_bootstrap, schema, topics, enabled):
    lanes = 2
    data = topics("data", partitions=2)
    cfg = lanes_config(pg_dsn, schema, kafka_bootstrap, topics, lanes, lane_index=enabled)
    h = Harvester(cfg).start()
    try:
        assert wait_until(lambda: all(u.leading for u in h.units), 30)
        if enabled:
            assert wait_until(lambda: all(u.lane_index is not None and u.lane_index.valid for u in h.units), 30)
            assert all(u.store._lane_index for u in h.units)
        else:
            assert all(u.lane_index is None for u in h.units)
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, data, [(b"k%d" % (i % 40), b"v%d" % i) for i in range(2_000)])
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 60)
    finally:
        h.stop(5)
    with psycopg.connect(pg_dsn) as conn:
        exists = LaneIndex(schema, "outbox", lanes).state(conn) != MISSING
    assert exists is enabled


def _index_names(pg_dsn: str, schema: str) -> set[str]:
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute("SELECT indexname FROM pg_indexes WHERE schemaname = %s AND tablename = 'outbox'", [schema])
        return {r[0] for r in rows}


@pytest.mark.parametrize("lanes,lane_index", [(2, True), (2, False), (1, True), (4, True)])
def test_a_configuration_drops_the_lane_indexes_it_does_not_use(
    pg_dsn, kafka_bootstrap, schema, topics, lanes, lane_index
):
    """Left by another lane count (the drain-then-switch of the README), or by this one before
    harvester.lane_index was turned off: each slows every insert. Lane 0's leader drops the labelled
    ones once its configuration holds the table and its own index is valid (with 4 lanes it builds
    that index first: a drop beside the build would deadlock with it); an index someone else made
    is left alone."""
    for old in (3, 2):
        _build(pg_dsn, LaneIndex(schema, "outbox", old))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE INDEX outbox_lanes5 ON "{schema}".outbox (created_at)')  # not ours
        conn.execute(f"COMMENT ON INDEX \"{schema}\".outbox_lanes5 IS 'outbox-reaper lane index (lanes=5)'")
    before = _index_names(pg_dsn, schema)
    assert {"outbox_lanes2", "outbox_lanes3", "outbox_lanes5"} <= before
    kept = {f"outbox_lanes{lanes}"} if lanes > 1 and lane_index else set()
    h = Harvester(lanes_config(pg_dsn, schema, kafka_bootstrap, topics, lanes, lane_index=lane_index)).start()
    try:
        assert wait_until(lambda: h.units[0].upkeep is not None and h.units[0].upkeep.retired is not None, 60)
        assert sorted(h.units[0].upkeep.retired) == sorted({"outbox_lanes2", "outbox_lanes3"} - kept)
        assert _index_names(pg_dsn, schema) == (before - {"outbox_lanes2", "outbox_lanes3"}) | kept
        if kept:  # the one in use is still used, and its build failed no time
            assert wait_until(lambda: all(u.lane_index is not None and u.lane_index.valid for u in h.units), 30)
            assert h.units[0].lane_index is not None and h.units[0].lane_index.failures == 0
    finally:
        h.stop(5)


def test_a_drop_behind_another_sessions_lock_is_cancelled_and_done_later(pg_dsn, schema, monkeypatch):
    """DROP INDEX CONCURRENTLY waits for every session holding a lock on the table, and holds back
    vacuum and builds meanwhile: cancelled after RETIRE_WAIT, it leaves the (labelled) index for the
    next attempt."""
    import time

    from harvester import lane_index as lane_index_mod
    from harvester.lane_index import NotHeld, retire_lane_indexes

    monkeypatch.setattr(lane_index_mod, "RETIRE_WAIT", 0.5)
    _build(pg_dsn, LaneIndex(schema, "outbox", 3))
    with psycopg.connect(pg_dsn) as app, psycopg.connect(pg_dsn, autocommit=True) as conn:
        app.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()  # open transaction: a lock
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            retire_lane_indexes(conn, schema, "outbox", None, lambda: True)
        assert time.monotonic() - started < 5
        app.rollback()
        with pytest.raises(NotHeld):  # not this configuration's any more: nothing dropped, tried later
            retire_lane_indexes(conn, schema, "outbox", None, lambda: False)
        assert retire_lane_indexes(conn, schema, "outbox", None, lambda: True) == ["outbox_lanes3"]
    assert "outbox_lanes3" not in _index_names(pg_dsn, schema)


def test_the_cancel_of_a_slow_drop_never_hits_the_next_statement(pg_dsn, monkeypatch):
    """Statements that end right around RETIRE_WAIT: the cancel either stops the statement itself
    or is not sent; the statement after it is never cancelled."""
    from psycopg import sql

    from harvester import lane_index as lane_index_mod

    monkeypatch.setattr(lane_index_mod, "RETIRE_WAIT", 0.1)
    cancelled = 0
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i in range(40):
            slow = sql.SQL("SELECT pg_sleep({s})").format(s=sql.Literal(0.09 + 0.001 * (i % 20)))
            try:
                lane_index_mod._drop_within(conn, slow)  # type: ignore[arg-type]
            except psycopg.errors.QueryCanceled:
                cancelled += 1
            conn.execute("SELECT pg_sleep(0.05)")  # never cancelled
    print(f"{cancelled} of 40 cancelled")


def test_an_index_of_the_name_on_another_expression_is_not_used_nor_labelled(pg_dsn, schema):
    """An operator's index that happens to bear the lane index's name: not marked through, not
    labelled (its comment kept), never dropped."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE INDEX outbox_lanes2 ON "{schema}".outbox (created_at)')
        conn.execute(f"COMMENT ON INDEX \"{schema}\".outbox_lanes2 IS 'the reports team'")
    keeper, used = _keeper(pg_dsn, schema)
    keeper.step()
    keeper.close()
    assert used == [False] and keeper.failures == 1  # its build finds the name taken
    with psycopg.connect(pg_dsn) as conn:
        comment = conn.execute(
            "SELECT obj_description(to_regclass(%s), 'pg_class')", [f'"{schema}".outbox_lanes2']
        ).fetchone()[0]
    assert comment == "the reports team"


def test_only_an_index_on_this_table_is_labelled_and_an_unlabelled_one_in_use_gets_the_label(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".archive (id bigint)')
        conn.execute(f'CREATE INDEX outbox_lanes4 ON "{schema}".archive (id)')  # the name, elsewhere
        index = LaneIndex(schema, "outbox", 4)
        assert index.build_step(conn) == MISSING  # IF NOT EXISTS passed over the name: not built
        label = conn.execute(
            "SELECT obj_description(to_regclass(%s), 'pg_class')", [f'"{schema}".outbox_lanes4']
        ).fetchone()[0]
        assert label is None
        # an index built without the label (an earlier version, an operator) is labelled by the
        # keeper that marks through it, so a later configuration may retire it
        conn.execute(f'DROP INDEX "{schema}".outbox_lanes4')
        two = LaneIndex(schema, "outbox", 2)
        conn.execute(two._create)
        assert two.state(conn) == VALID and not two.labelled
    keeper, used = _keeper(pg_dsn, schema)
    keeper.step()
    keeper.close()
    with psycopg.connect(pg_dsn) as conn:
        assert two.state(conn) == VALID and two.labelled and used[-1] is True


def test_nothing_is_dropped_while_another_configuration_holds_the_table(pg_dsn, kafka_bootstrap, schema, topics):
    from datetime import timedelta

    from harvester.db_pool import make_pool as pool_of
    from harvester.publishing.ownership import OutboxClaim, layout_of

    _build(pg_dsn, LaneIndex(schema, "outbox", 3))
    p = pool_of(pg_dsn, 1, name="other-layout")
    try:
        other = OutboxClaim(p, schema, "outbox", layout_of("c", "g", "t", "default", 0, 3), "another deployment")
        with psycopg.connect(pg_dsn) as conn:
            now = conn.execute("SELECT clock_timestamp()").fetchone()[0]
        other.hold(now + timedelta(seconds=300))  # beyond every wait below, however slow the machine
        h = Harvester(lanes_config(pg_dsn, schema, kafka_bootstrap, topics, 1)).start()
        try:
            assert wait_until(lambda: h.units[0].leading, 30)
            import time

            time.sleep(3)
            assert h.units[0].upkeep is not None and h.units[0].upkeep.retired is None
            assert "outbox_lanes3" in _index_names(pg_dsn, schema)
        finally:
            h.stop(5)
    finally:
        p.close()


def _keeper(dsn: str, schema: str, builder: bool = True, lanes: int = 2) -> tuple[LaneIndexKeeper, list[bool]]:
    used: list[bool] = []
    return LaneIndexKeeper(LaneIndex(schema, "outbox", lanes), dsn, builder, used.append, get_log("test")), used


def test_a_build_that_keeps_failing_is_retried_ever_less_often(pg_dsn, schema):
    """A build the server cancels every time (here a 1 ms statement_timeout; in life a timeout, a
    deadlock) backs off, doubling, whatever the drop of its invalid leftover in between; marks go
    along the primary key meanwhile. Once it succeeds, the count of failures starts again."""
    with psycopg.connect(pg_dsn) as conn:
        insert_rows(conn, schema, "t", [(b"k%d" % i, b"v" * 100) for i in range(20_000)])
    keeper, used = _keeper(pg_dsn + "?options=-c%20statement_timeout%3D1", schema)
    waits = [keeper.step() for _ in range(8)]
    assert keeper.failures >= 4 and not keeper.valid and not any(used), (waits, keeper.failures)
    after_failures = [w for w in waits if w > 1.0]
    assert after_failures == sorted(after_failures) and after_failures[-1] >= 16, waits
    keeper.close()
    keeper.dsn = pg_dsn  # the timeout lifted
    for _ in range(3):
        if keeper.step() == RECHECK_VALID:
            break
    assert keeper.valid and used[-1] is True and keeper.failures == 0
    keeper.close()


def test_a_dropped_index_switches_the_lane_back_at_the_next_check(pg_dsn, schema):
    index = LaneIndex(schema, "outbox", 2)
    _build(pg_dsn, index)
    keeper, used = _keeper(pg_dsn, schema, builder=False)
    assert keeper.step() == RECHECK_VALID and used == [True]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP INDEX "{schema}"."{index.name}"')
    keeper.step()
    assert used == [True, False] and not keeper.valid
    keeper.close()


def test_an_invalid_index_is_left_alone_while_another_session_holds_the_table_for_a_build(pg_dsn, schema):
    """A build by another role hides from pg_stat_progress_create_index; its SHARE UPDATE EXCLUSIVE
    lock on the table does not: the builder waits instead of dropping the index under it."""
    index = LaneIndex(schema, "outbox", 2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO \"{schema}\".outbox (topic, key, value) VALUES ('t', 'k', 'v'), ('t', 'k', 'v')")
        lane = LANE_SQL.format(lanes=2)  # a build of the lane expression that fails half way
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(f'CREATE UNIQUE INDEX CONCURRENTLY "{index.name}" ON "{schema}".outbox (({lane}))')
    holder = psycopg.connect(pg_dsn)
    try:
        holder.execute(f'LOCK TABLE "{schema}".outbox IN SHARE UPDATE EXCLUSIVE MODE')
        keeper, used = _keeper(pg_dsn, schema)
        keeper.step()
        with psycopg.connect(pg_dsn) as conn:
            assert index.state(conn) == BUILDING  # still there: not dropped
        holder.rollback()
        keeper.step()  # now dropped
        keeper.step()  # and built
        assert keeper.valid and used[-1] is True
        keeper.close()
    finally:
        holder.close()


def test_a_build_that_leaves_no_index_counts_as_failed_the_first_time(pg_dsn, schema):
    """The name is taken by an index of another table: CREATE INDEX ... IF NOT EXISTS skips, and
    the table still has none. That is a failed build from the first step on (backed off, logged)."""
    index = LaneIndex(schema, "outbox", 2)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{schema}".other (x int)')
        conn.execute(f'CREATE INDEX "{index.name}" ON "{schema}".other (x)')
    keeper, used = _keeper(pg_dsn, schema)
    assert keeper.step() == 2.0 and keeper.failures == 1 and used == [False]
    assert keeper.step() == 4.0 and keeper.failures == 2
    keeper.close()
