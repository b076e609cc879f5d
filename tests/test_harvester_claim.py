"""One configuration harvests an outbox table at a time (harvester.publishing.ownership), on the real Postgres:
the hold against a model over random sequences, the takeover only after `held_until`, the table
created where missing, and a role that may not create it."""

from __future__ import annotations

import uuid
from datetime import timedelta

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter
from support.harness import limited_role
from support.teardown import drop_schema

from harvester.db_pool import make_pool
from harvester.publishing.ownership import CLAIM_AHEAD, ClaimTableMissing, OutboxClaim, OutboxClaimed, layout_of

LAYOUTS = [
    layout_of("c1", "g", "t", "default", 0, 1),
    layout_of("c1", "g", "t", "default", 0, 2),
    layout_of("c1", "h", "u", "default", 0, 1),
]


@pytest.fixture
def pool(pg_dsn):
    p = make_pool(pg_dsn, 2, name="claim-test")
    yield p
    p.close()


def server_now(pg_dsn):
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def read_row(pg_dsn, schema, table="outbox"):
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute(
            f'SELECT layout, held_until, holder FROM "{schema}".harvest_claim WHERE outbox = %s', [table]
        ).fetchone()


# Each step: which layout holds, and a deadline hours before or after now (far from the clock's
# movement during the test, so the model's "has it passed" is never a close call).
steps = st.lists(st.tuples(st.integers(0, len(LAYOUTS) - 1), st.integers(-48, 48)), min_size=1, max_size=12)


def test_every_part_of_a_configuration_that_decides_who_marks_what_is_in_its_layout():
    """Another Kafka cluster is another election; another group or topic too; another name or lane
    count splits the table differently; reordering harvester.outboxes moves it to other partitions."""
    base = ("c1", "g", "t", "orders", 0, 2)
    for i, other in enumerate(("c2", "g2", "t2", "billing", 1, 3)):
        changed = list(base)
        changed[i] = other
        assert layout_of(*changed) != layout_of(*base), changed  # type: ignore[arg-type]
    assert layout_of(*base) == layout_of(*base)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=steps)
def test_a_hold_follows_the_model(pg_dsn, schema, pool, steps):
    """Same layout: held_until only grows. Another layout: refused while held_until is ahead of the
    server's clock, naming the holder; takes the table (its own deadline) once it has passed."""
    table = f"t_{uuid.uuid4().hex[:8]}"  # a fresh row per example
    now = server_now(pg_dsn)
    claims = [OutboxClaim(pool, schema, table, layout, f"holder {i}") for i, layout in enumerate(LAYOUTS)]
    state: tuple[int, object] | None = None  # (layout index, held_until)
    for who, hours in steps:
        deadline = now + timedelta(hours=hours, minutes=30)  # never a whole hour: never equal to now
        wanted = deadline + CLAIM_AHEAD
        claims[who].held = None  # ask the database every time (the cache is tested below)
        if state is None or state[0] == who or state[1] < now:
            claims[who].hold(deadline)
            held = wanted if state is None or state[0] != who else max(state[1], wanted)
            state = (who, held)
            assert claims[who].held == held
        else:
            with pytest.raises(OutboxClaimed) as refused:
                claims[who].hold(deadline)
            assert refused.value.layout == LAYOUTS[state[0]] and refused.value.holder == f"holder {state[0]}"
            assert LAYOUTS[state[0]] in str(refused.value) and LAYOUTS[who] in str(refused.value)
        row = read_row(pg_dsn, schema, table)
        assert (row[0], row[1]) == (LAYOUTS[state[0]], state[1])


def test_a_layout_takes_the_table_only_after_the_others_deadline(pg_dsn, schema, pool):
    old = OutboxClaim(pool, schema, "outbox", LAYOUTS[0], "old")
    new = OutboxClaim(pool, schema, "outbox", LAYOUTS[1], "new")
    now = server_now(pg_dsn)
    old.hold(now + timedelta(seconds=1))  # held until now + 2 s
    with pytest.raises(OutboxClaimed):
        new.hold(now + timedelta(seconds=10))
    # Held within what it holds, under the same clock anchor: no statement at all (a paused old
    # reaper's next mark goes on with a deadline no later than that, which the mark's own deadline
    # check bounds). Under a new anchor (the server's clock may have stepped) it asks again.
    held = old.held
    old.pool = None  # type: ignore[assignment]  # would fail if it were used
    old.hold(now + timedelta(seconds=1, milliseconds=500))
    assert old.held == held
    with pytest.raises(AttributeError):
        old.hold(now + timedelta(seconds=1, milliseconds=500), clock_generation=1)
    old.pool = pool
    old.forget()
    import time

    while server_now(pg_dsn) <= held:
        time.sleep(0.1)
    new.hold(server_now(pg_dsn) + timedelta(seconds=5))
    assert read_row(pg_dsn, schema)[0] == LAYOUTS[1]
    # the old layout, resuming, cannot take it back while the new one holds it
    with pytest.raises(OutboxClaimed) as refused:
        old.hold(server_now(pg_dsn) + timedelta(seconds=5))
    assert refused.value.holder == "new"


def test_a_refusal_is_counted_and_logged_once_per_new_holder(pg_dsn, schema, pool):
    registry = CollectorRegistry()
    conflicts = Counter("conflicts", "test", registry=registry)
    logged: list[dict] = []

    class Log:
        def error(self, event, **kw):
            logged.append({"event": event, **kw})

    claim = OutboxClaim(pool, schema, "outbox", LAYOUTS[0], "me")
    why = OutboxClaimed("s.outbox", LAYOUTS[0], LAYOUTS[1], "them", server_now(pg_dsn))
    for _ in range(5):
        claim.report_refusal(why, Log(), conflicts)  # type: ignore[arg-type]
    assert registry.get_sample_value("conflicts_total") == 5
    assert len(logged) == 1 and LAYOUTS[1] in logged[0]["error"]
    claim.report_refusal(OutboxClaimed("s.outbox", LAYOUTS[0], LAYOUTS[2], "x", why.held_until), Log(), conflicts)  # type: ignore[arg-type]
    assert len(logged) == 2
    # a table it cannot hold at all is counted too, under its own message
    claim.report_refusal(ClaimTableMissing("no table"), Log(), conflicts)  # type: ignore[arg-type]
    assert registry.get_sample_value("conflicts_total") == 7
    assert len(logged) == 3 and logged[-1]["event"] != logged[0]["event"]


def test_a_schema_without_the_table_gets_it_from_the_reaper(pg_dsn, bare_schema, pool):
    claim = OutboxClaim(pool, bare_schema, "orders", LAYOUTS[0], "me")
    claim.hold(server_now(pg_dsn) + timedelta(seconds=5))
    assert read_row(pg_dsn, bare_schema, "orders")[0] == LAYOUTS[0]
    # the same table as migration 0011 makes (the migrated schema's, compared column by column)
    with psycopg.connect(pg_dsn) as conn:
        cols = conn.execute(
            "SELECT table_schema, column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_name = 'harvest_claim' AND table_schema = %s ORDER BY ordinal_position",
            [bare_schema],
        ).fetchall()
    assert [c[1] for c in cols] == ["outbox", "layout", "held_until", "holder", "since"]


def test_a_role_that_may_not_create_the_table_is_told_the_statement_and_marks_nothing(pg_dsn, bare_schema):
    with limited_role(pg_dsn, bare_schema, "noclaim") as dsn:
        p = make_pool(dsn, 1, name="claim-noowner")
        try:
            claim = OutboxClaim(p, bare_schema, "orders", LAYOUTS[0], "me")
            with pytest.raises(ClaimTableMissing) as missing:
                claim.hold(server_now(pg_dsn) + timedelta(seconds=5))
            text = str(missing.value)
            assert f'SET search_path TO "{bare_schema}"' in text and "CREATE TABLE IF NOT EXISTS harvest_claim" in text
            assert claim.held is None
        finally:
            p.close()


def test_identifiers_are_checked_before_any_sql(pool):
    from tracker.errors import InvalidIdentifier

    with pytest.raises(InvalidIdentifier):
        OutboxClaim(pool, 'x"; DROP TABLE outbox; --', "outbox", LAYOUTS[0], "me")
    with pytest.raises(InvalidIdentifier):
        OutboxClaim(pool, "reaper", "out box", LAYOUTS[0], "me")


def test_a_role_without_rights_on_the_table_is_told_the_grant(pg_dsn, schema):
    with limited_role(pg_dsn, schema, "nogrant") as dsn:
        p = make_pool(dsn, 1, name="claim-nogrant")
        try:
            claim = OutboxClaim(p, schema, "outbox", LAYOUTS[0], "me")
            with pytest.raises(ClaimTableMissing) as refused:
                claim.hold(server_now(pg_dsn) + timedelta(seconds=5))
            assert f'GRANT SELECT, INSERT, UPDATE ON "{schema}"."harvest_claim"' in str(refused.value)
            assert read_row(pg_dsn, schema) is None  # nothing held
        finally:
            p.close()


def test_units_creating_the_table_at_once_and_a_migration_all_succeed(pg_dsn):
    """Eight units of fresh schemas race to create the table, with `reaper migrate` beside them:
    they queue on migrate's advisory lock, and none fails."""
    import threading

    from tracker import schema as schema_mod

    for _ in range(5):
        name = f"race_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        p = make_pool(pg_dsn, 8, name="claim-race")
        errors: list[BaseException] = []
        now = server_now(pg_dsn)

        def unit(i: int) -> None:
            try:
                OutboxClaim(p, name, "outbox", LAYOUTS[0], f"unit {i}").hold(now + timedelta(seconds=30))
            except BaseException as exc:
                errors.append(exc)

        def migrate() -> None:
            try:
                schema_mod.migrate(pg_dsn, name)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=unit, args=(i,)) for i in range(8)] + [threading.Thread(target=migrate)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert errors == []
            assert read_row(pg_dsn, name)[0] == LAYOUTS[0]
        finally:
            p.close()
            drop_schema(pg_dsn, name, if_exists=False)


def test_a_hold_behind_a_locked_claim_row_fails_within_its_lock_timeout(pg_dsn, schema, pool):
    """An operator's open transaction on the row: the hold gives up after HOLD_LOCK_TIMEOUT (the
    marker treats it as a failed mark) instead of holding up the unit's revocation."""
    import time

    claim = OutboxClaim(pool, schema, "outbox", LAYOUTS[0], "me")
    claim.hold(server_now(pg_dsn) + timedelta(seconds=5))
    with psycopg.connect(pg_dsn) as blocker:
        blocker.execute(f'SELECT * FROM "{schema}".harvest_claim FOR UPDATE').fetchall()
        claim.forget()
        started = time.monotonic()
        with pytest.raises(psycopg.errors.LockNotAvailable):
            claim.hold(server_now(pg_dsn) + timedelta(seconds=10))
        assert time.monotonic() - started < 5
        assert not claim.holding
        blocker.rollback()
    claim.hold(server_now(pg_dsn) + timedelta(seconds=10))
    assert claim.holding
