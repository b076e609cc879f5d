"""The inbox keeps the caller's transaction sacred in every connection mode, sync and async, directly
and through the real PgBouncer in transaction pooling mode: the connection-mode matrix of
test_tracker_modes.py for `claim` and `run_once`, each call

1. succeeding, then the caller commits: the id (and the effect) are there with the caller's rows;
2. succeeding, then the caller rolls back: nothing is left, and nothing was visible meanwhile;
3. failing inside the database (a trigger refuses the id's row), then the caller goes on and
   commits: its own rows are there, no id and no effect.

A mode with no caller transaction checks instead that the call is its own transaction."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import pq, sql
from support.teardown import drop_schema
from test_tracker_modes import ASYNC_MODES, SYNC_MODES, async_mode, sync_mode

from tracker import schema as schema_mod
from tracker.errors import NoCallerTransaction
from tracker.inbox import AsyncInbox, Inbox

POISON = """
CREATE TABLE caller_rows (tag text NOT NULL);
CREATE FUNCTION poison_inbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.message_id LIKE 'poison-%' THEN
    RAISE EXCEPTION 'poisoned: inbox row';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER poison BEFORE INSERT ON inbox FOR EACH ROW EXECUTE FUNCTION poison_inbox();
"""
OPS = ["claim", "run_once"]
OUTCOMES = ["committed", "rolled_back", "failed"]
NO_PREPARE = {"prepare_threshold": None}


@pytest.fixture(scope="module")
def poisoned(pg_dsn):
    """One migrated, poisoned schema for the module's cells (on each worker), as in the tracker's
    matrix: migrating one per test cost more than its cells. Every cell's message id is its own,
    and each cell starts with no caller rows (_clear)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, name)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(name)))
        c.execute(POISON)
    yield name
    drop_schema(pg_dsn, name)


def _state(dsn: str, schema: str, mid: str, extra: dict[str, Any]) -> tuple[int, list[str]]:
    with psycopg.connect(dsn, autocommit=True, **extra) as c:
        (ids,) = c.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE message_id = %s").format(sql.Identifier(schema, "inbox")), [mid]
        ).fetchone()
        tags = [t for (t,) in c.execute(sql.SQL("SELECT tag FROM {}").format(sql.Identifier(schema, "caller_rows")))]
    return ids, sorted(tags)


def _errors(mode: str) -> tuple[type[BaseException], ...]:
    if "asyncpg" in mode:
        import asyncpg

        return (asyncpg.exceptions.RaiseError,)
    return (psycopg.errors.RaiseException,)


def _check(mode: str, op: str, outcome: str, transactional: bool, ids: int, tags: list[str]) -> None:
    if outcome == "rolled_back" and transactional:
        assert (ids, tags) == (0, []), (mode, op)
        return
    assert "after" in tags, (mode, op, outcome, tags)
    ran = op == "run_once" and outcome != "failed"
    assert tags.count("effect") == (1 if ran else 0), (mode, op, outcome, tags)
    assert ids == (0 if outcome == "failed" else 1), (mode, op, outcome)


def _sync_cell(dsn: str, schema: str, mode: str, op: str, outcome: str, extra: dict[str, Any]) -> None:
    mid = ("poison-" if outcome == "failed" else "m-") + uuid.uuid4().hex
    box = Inbox("c", schema=schema, registry=None)
    with sync_mode(mode, dsn, schema, outcome != "rolled_back", extra) as caller:
        if mode != "autocommit_off_idle":
            caller.write("before")

        def call() -> bool:
            if op == "claim":
                return box.claim(caller.session, mid)
            return box.run_once(caller.session, mid, lambda _s: caller.write("effect")).first_time

        if op == "claim" and not caller.transactional:
            # No transaction for the effect to share: a claim would commit alone, ahead of it.
            with pytest.raises(NoCallerTransaction):
                call()
            caller.write("after")
            assert _state(dsn, schema, mid, extra)[0] == 0
            return
        if outcome == "failed":
            with pytest.raises(_errors(mode)):
                call()
        else:
            assert call() is True
        if caller.transactional and mode not in ("pipeline", "pipeline_autocommit_block"):
            assert caller.raw.info.transaction_status == pq.TransactionStatus.INTRANS
        if caller.transactional:
            assert _state(dsn, schema, mid, extra)[0] == 0  # nothing committed behind the caller's back
        elif outcome != "failed":
            assert caller.raw.info.transaction_status == pq.TransactionStatus.IDLE
        caller.write("after")
    _check(mode, op, outcome, caller.transactional, *_state(dsn, schema, mid, extra))


async def _async_cell(dsn: str, schema: str, mode: str, op: str, outcome: str, extra: dict[str, Any]) -> None:
    mid = ("poison-" if outcome == "failed" else "m-") + uuid.uuid4().hex
    box = AsyncInbox("c", schema=schema, registry=None)
    async with async_mode(mode, dsn, schema, outcome != "rolled_back", extra) as caller:
        if mode != "autocommit_off_idle":
            await caller.write("before")

        async def call() -> bool:
            if op == "claim":
                return await box.claim(caller.session, mid)
            return (await box.run_once(caller.session, mid, lambda _s: caller.write("effect"))).first_time

        if op == "claim" and not caller.transactional:
            with pytest.raises(NoCallerTransaction):
                await call()
            await caller.write("after")
            assert _state(dsn, schema, mid, extra)[0] == 0
            return
        if outcome == "failed":
            with pytest.raises(_errors(mode)):
                await call()
        else:
            assert await call() is True
        if caller.transactional:
            assert _state(dsn, schema, mid, extra)[0] == 0
        await caller.write("after")
    _check(mode, op, outcome, caller.transactional, *_state(dsn, schema, mid, extra))


def _clear(dsn: str, schema: str, extra: dict[str, Any]) -> None:
    with psycopg.connect(dsn, autocommit=True, **extra) as c:
        c.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(schema, "caller_rows")))


@pytest.mark.parametrize("mode", SYNC_MODES)
def test_sync_face_in_every_mode(pg_dsn, poisoned, mode):
    for op in OPS:
        for outcome in OUTCOMES:
            _clear(pg_dsn, poisoned, {})
            _sync_cell(pg_dsn, poisoned, mode, op, outcome, {})


@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_async_face_in_every_mode(pg_dsn, poisoned, mode):
    for op in OPS:
        for outcome in OUTCOMES:
            _clear(pg_dsn, poisoned, {})
            asyncio.run(_async_cell(pg_dsn, poisoned, mode, op, outcome, {}))


@pytest.mark.xdist_group("pgbouncer")
@pytest.mark.parametrize("mode", [m for m in SYNC_MODES if m != "always_prepare"])
def test_sync_face_through_pgbouncer(pgbouncer_dsn, poisoned, mode):
    for op in OPS:
        for outcome in OUTCOMES:
            _clear(pgbouncer_dsn, poisoned, NO_PREPARE)
            _sync_cell(pgbouncer_dsn, poisoned, mode, op, outcome, NO_PREPARE)


@pytest.mark.xdist_group("pgbouncer")
@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_async_face_through_pgbouncer(pgbouncer_dsn, poisoned, mode):
    for op in OPS:
        for outcome in OUTCOMES:
            _clear(pgbouncer_dsn, poisoned, NO_PREPARE)
            asyncio.run(_async_cell(pgbouncer_dsn, poisoned, mode, op, outcome, NO_PREPARE))
