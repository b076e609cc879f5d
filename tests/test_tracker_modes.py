"""The caller's transaction is sacred, in every connection mode, sync and async.

A matrix: {sync, async} x {each connection mode} x {open, enqueue, add_items, close, ack,
exactly_once, status}. For each cell, against the real Postgres (and again through the real
PgBouncer, in test_tracker_modes_pgbouncer.py):

1. success, then the caller commits: the caller's own rows and the call's work are both there;
2. success, then the caller rolls back: nothing of either is left; and while the caller's
   transaction is open, another connection sees nothing of the call (the tracker committed nothing);
3. a call that fails *inside the database* (a trigger refuses a row the call writes, late in the
   call, after it wrote other rows), then the caller goes on and commits: the caller's
   transaction was usable, its own rows are there, and nothing of the failed call is.

Modes with no caller transaction (autocommit, no block) check instead that a call is its own
transaction: committed when it returns, nothing left when it fails, the connection left idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import pq
from psycopg.rows import dict_row, namedtuple_row
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from support.teardown import drop_schema
from test_tracker_support import snapshot

import tracker
from tracker import schema as schema_mod
from tracker.aio import AsyncTracker

POISON = """
CREATE TABLE caller_rows (tag text NOT NULL);
CREATE FUNCTION poison_batch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' AND NEW.user_key = 'poison-open' THEN
    RAISE EXCEPTION 'poisoned: open';
  END IF;
  IF TG_OP = 'UPDATE' THEN
    IF NEW.user_key = 'poison-add' AND NEW.total > OLD.total THEN
      RAISE EXCEPTION 'poisoned: add';
    END IF;
  END IF;
  RETURN NEW;
END $$;
CREATE FUNCTION poison_outbox() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF NEW.topic = 'poison' THEN
    RAISE EXCEPTION 'poisoned: outbox row';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER poison BEFORE INSERT OR UPDATE ON batch FOR EACH ROW EXECUTE FUNCTION poison_batch();
CREATE TRIGGER poison BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION poison_outbox();
-- acks are claims: a claim of the poisoned closed batch is refused
CREATE FUNCTION poison_claim() RETURNS trigger LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
  IF (SELECT user_key FROM batch WHERE id = NEW.batch_id) = 'fixture-poison-close' THEN
    RAISE EXCEPTION 'poisoned: ack claim';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER poison BEFORE INSERT ON ack_claim FOR EACH ROW EXECUTE FUNCTION poison_claim();
"""


# What a cell's tracker calls can write: emptied before each cell (_prepare), so every cell meets
# only its own fixture rows, as in a fresh schema.
CELL_TABLES = (  # referencing tables before the tables they reference
    "caller_rows",
    "ack_claim",
    "ack_settle_request",
    "child_finished",
    "group_failure",
    "failure_reason",
    "spark_fanout_run",
    "batch_group",
    "outbox",
    "outbox_dead",
    "batch",
)


@pytest.fixture(scope="module")
def poisoned(pg_dsn):
    """One migrated, poisoned schema for the module's cells (on each worker): migrating a schema per
    test cost more than the cells themselves. Each cell starts from empty tables (_prepare)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, name)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'SET search_path TO "{name}"')
        c.execute(POISON)
    yield name
    drop_schema(pg_dsn, name)


# ---------------------------------------------------------------- the caller, in each mode


@dataclass
class Caller:
    session: Any
    write: Callable[[str], Any]  # the caller's own business write (sync, or a coroutine)
    transactional: bool = True  # False: autocommit with no block, each call commits itself
    raw: Any = None  # the psycopg connection underneath


class _Rollback(Exception):
    pass


def _own(schema: str) -> str:
    return f'INSERT INTO "{schema}".caller_rows (tag) VALUES (%s)'


def _sa_own(schema: str) -> sa.TextClause:
    return sa.text(f'INSERT INTO "{schema}".caller_rows (tag) VALUES (:tag)')


def _psycopg_caller(conn: psycopg.Connection, schema: str, transactional: bool = True) -> Caller:
    return Caller(conn, lambda tag: conn.execute(_own(schema), [tag]), transactional, conn)


@contextlib.contextmanager
def sync_mode(mode: str, dsn: str, schema: str, commit: bool, extra: dict[str, Any]) -> Iterator[Caller]:
    sa_url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    kwargs: dict[str, Any] = extra | {
        "dict_row": {"row_factory": dict_row},
        "namedtuple_row": {"row_factory": namedtuple_row},
        "client_cursor": {"cursor_factory": psycopg.ClientCursor},
        "no_prepare": {"prepare_threshold": None},
        "always_prepare": {"prepare_threshold": 0},
    }.get(mode, {})
    if mode in (
        "autocommit_off",
        "dict_row",
        "namedtuple_row",
        "client_cursor",
        "no_prepare",
        "always_prepare",
        "autocommit_off_idle",
    ):
        with psycopg.connect(dsn, **kwargs) as conn:
            yield _psycopg_caller(conn, schema)
            conn.commit() if commit else conn.rollback()
    elif mode == "autocommit_no_block":
        with psycopg.connect(dsn, autocommit=True, **extra) as conn:
            yield _psycopg_caller(conn, schema, transactional=False)
    elif mode in ("autocommit_block", "autocommit_nested_block", "pipeline_autocommit_block"):
        with psycopg.connect(dsn, autocommit=True, **extra) as conn:
            try:
                with contextlib.ExitStack() as stack:
                    if mode == "pipeline_autocommit_block":
                        stack.enter_context(conn.pipeline())
                    stack.enter_context(conn.transaction())
                    if mode == "autocommit_nested_block":
                        conn.execute(_own(schema), ["outer"])
                        stack.enter_context(conn.transaction())
                    yield _psycopg_caller(conn, schema)
                    if not commit:
                        raise _Rollback
            except _Rollback:
                pass
    elif mode == "pipeline":
        with psycopg.connect(dsn, **extra) as conn:
            with conn.pipeline():
                yield _psycopg_caller(conn, schema)
            conn.commit() if commit else conn.rollback()
    elif mode in ("sa_session", "sa_begin_nested"):
        engine = sa.create_engine(sa_url, poolclass=sa.pool.NullPool, connect_args=extra)
        try:
            with Session(engine) as session:
                with contextlib.ExitStack() as stack:
                    if mode == "sa_begin_nested":
                        session.execute(_sa_own(schema), {"tag": "outer"})
                        stack.enter_context(session.begin_nested())
                    yield Caller(
                        session,
                        lambda tag: session.execute(_sa_own(schema), {"tag": tag}),
                        raw=session.connection().connection.driver_connection,
                    )
                session.commit() if commit else session.rollback()
        finally:
            engine.dispose()
    elif mode == "sa_connection":
        engine = sa.create_engine(sa_url, poolclass=sa.pool.NullPool, connect_args=extra)
        try:
            with engine.connect() as sa_conn:
                sa_conn.begin()
                yield Caller(
                    sa_conn,
                    lambda tag: sa_conn.execute(_sa_own(schema), {"tag": tag}),
                    raw=sa_conn.connection.driver_connection,
                )
                sa_conn.commit() if commit else sa_conn.rollback()
        finally:
            engine.dispose()
    else:
        raise AssertionError(mode)


def _apsycopg_caller(conn: psycopg.AsyncConnection, schema: str, transactional: bool = True) -> Caller:
    async def write(tag: str) -> None:
        await conn.execute(_own(schema), [tag])

    return Caller(conn, write, transactional, conn)


@contextlib.asynccontextmanager
async def async_mode(mode: str, dsn: str, schema: str, commit: bool, extra: dict[str, Any]) -> AsyncIterator[Caller]:
    sa_url = dsn.replace("postgresql://", "postgresql+psycopg://", 1)
    if mode in ("autocommit_off", "dict_row", "autocommit_off_idle", "no_prepare"):
        kwargs: dict[str, Any] = extra | {
            "dict_row": {"row_factory": dict_row},
            "no_prepare": {"prepare_threshold": None},
        }.get(mode, {})
        async with await psycopg.AsyncConnection.connect(dsn, **kwargs) as conn:
            yield _apsycopg_caller(conn, schema)
            await (conn.commit() if commit else conn.rollback())
    elif mode == "autocommit_no_block":
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, **extra) as conn:
            yield _apsycopg_caller(conn, schema, transactional=False)
    elif mode in ("autocommit_block", "autocommit_nested_block"):
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, **extra) as conn:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    await stack.enter_async_context(conn.transaction())
                    if mode == "autocommit_nested_block":
                        await conn.execute(_own(schema), ["outer"])
                        await stack.enter_async_context(conn.transaction())
                    yield _apsycopg_caller(conn, schema)
                    if not commit:
                        raise _Rollback
            except _Rollback:
                pass
    elif mode == "pipeline":
        async with await psycopg.AsyncConnection.connect(dsn, **extra) as conn:
            async with conn.pipeline():
                yield _apsycopg_caller(conn, schema)
            await (conn.commit() if commit else conn.rollback())
    elif mode in ("sa_session", "sa_begin_nested"):
        engine = create_async_engine(sa_url, poolclass=sa.pool.NullPool, connect_args=extra)
        try:
            async with AsyncSession(engine) as session:

                async def write(tag: str) -> None:
                    await session.execute(_sa_own(schema), {"tag": tag})

                async with contextlib.AsyncExitStack() as stack:
                    if mode == "sa_begin_nested":
                        await write("outer")
                        await stack.enter_async_context(session.begin_nested())
                    raw = (await (await session.connection()).get_raw_connection()).driver_connection
                    yield Caller(session, write, raw=raw)
                await (session.commit() if commit else session.rollback())
        finally:
            await engine.dispose()
    elif mode == "sa_connection":
        engine = create_async_engine(sa_url, poolclass=sa.pool.NullPool, connect_args=extra)
        try:
            async with engine.connect() as sa_conn:
                await sa_conn.begin()

                async def write(tag: str) -> None:
                    await sa_conn.execute(_sa_own(schema), {"tag": tag})

                raw = (await sa_conn.get_raw_connection()).driver_connection
                yield Caller(sa_conn, write, raw=raw)
                await (sa_conn.commit() if commit else sa_conn.rollback())
        finally:
            await engine.dispose()
    elif mode.startswith("asyncpg"):
        import asyncpg

        # asyncpg prepares every statement; through PgBouncer < 1.21 its cache must be off
        pg_kwargs = {"statement_cache_size": 0} if "prepare_threshold" in extra else {}
        conn = await asyncpg.connect(dsn, **pg_kwargs)
        try:

            async def awrite(tag: str) -> None:
                await conn.execute(f'INSERT INTO "{schema}".caller_rows (tag) VALUES ($1)', tag)

            if mode == "asyncpg_no_block":
                yield Caller(conn, awrite, False, conn)
            else:
                try:
                    async with contextlib.AsyncExitStack() as stack:
                        await stack.enter_async_context(conn.transaction())
                        if mode == "asyncpg_nested":
                            await awrite("outer")
                            await stack.enter_async_context(conn.transaction())
                        yield Caller(conn, awrite, True, conn)
                        if not commit:
                            raise _Rollback
                except _Rollback:
                    pass
        finally:
            await conn.close()
    elif mode in ("sa_asyncpg_session", "sa_asyncpg_begin_nested"):
        pg_kwargs = (
            {"statement_cache_size": 0, "prepared_statement_cache_size": 0} if "prepare_threshold" in extra else {}
        )
        engine = create_async_engine(
            dsn.replace("postgresql://", "postgresql+asyncpg://", 1), poolclass=sa.pool.NullPool, connect_args=pg_kwargs
        )
        try:
            async with AsyncSession(engine) as session:

                async def swrite(tag: str) -> None:
                    await session.execute(_sa_own(schema), {"tag": tag})

                async with contextlib.AsyncExitStack() as stack:
                    if mode == "sa_asyncpg_begin_nested":
                        await swrite("outer")
                        await stack.enter_async_context(session.begin_nested())
                    raw = (await (await session.connection()).get_raw_connection()).driver_connection
                    yield Caller(session, swrite, raw=raw)
                await (session.commit() if commit else session.rollback())
        finally:
            await engine.dispose()
    else:
        raise AssertionError(mode)


def in_transaction(raw: Any) -> bool:
    if hasattr(raw, "is_in_transaction"):  # asyncpg
        return raw.is_in_transaction()
    return raw.info.transaction_status == pq.TransactionStatus.INTRANS


def idle(raw: Any) -> bool:
    if hasattr(raw, "is_in_transaction"):
        return not raw.is_in_transaction()
    return raw.info.transaction_status == pq.TransactionStatus.IDLE


SYNC_MODES = [
    "autocommit_off",
    "autocommit_off_idle",
    "autocommit_no_block",
    "autocommit_block",
    "autocommit_nested_block",
    "pipeline",
    "pipeline_autocommit_block",
    "dict_row",
    "namedtuple_row",
    "client_cursor",
    "no_prepare",
    "always_prepare",
    "sa_session",
    "sa_connection",
    "sa_begin_nested",
]
ASYNC_MODES = [
    "autocommit_off",
    "autocommit_off_idle",
    "autocommit_no_block",
    "autocommit_block",
    "autocommit_nested_block",
    "pipeline",
    "dict_row",
    "no_prepare",
    "sa_session",
    "sa_connection",
    "sa_begin_nested",
    "asyncpg_no_block",
    "asyncpg_transaction",
    "asyncpg_nested",
    "sa_asyncpg_session",
    "sa_asyncpg_begin_nested",
]
OPS = ["open", "open_child", "enqueue", "add_items", "close", "ack", "fail", "failures", "exactly_once", "status"]


# ---------------------------------------------------------------- the operations, good and poisoned


@dataclass
class Fixture:
    """Committed batches the operations work on, made before the caller's transaction."""

    open_batch: tracker.Batch  # open, 3 items
    closed_batch: tracker.Batch  # closed, 3 items pending, completion topic 'done'
    poison_batch: tracker.Batch  # open, user_key poison-add (its add fails), 3 items
    poison_closed: tracker.Batch  # closed, completion topic 'poison' (its completion fails), 3 items
    poison_empty: tracker.Batch  # open, nothing in it, completion topic 'poison' (its close fails)


def _prepare(dsn: str, schema: str, extra: dict[str, Any]) -> Fixture:
    t = tracker.Tracker(schema=schema)
    with psycopg.connect(dsn, **extra) as c:
        # DELETE, not TRUNCATE: a few rows each, and TRUNCATE's new files cost more than the cell
        c.execute("; ".join(f'DELETE FROM "{schema}".{table}' for table in CELL_TABLES))
        ob = t.open_batch(c, user_key="fixture-open")
        t.add_items(c, ob, 3)
        cb = t.open_batch(c, user_key="fixture-closed", completion_topic="done")
        t.add_items(c, cb, 3)
        t.close_batch(c, cb)
        pb = t.open_batch(c, user_key="fixture-poison-add")
        t.enqueue(c, pb, [b"a", b"b", b"c"], topic="items")
        c.execute(f'UPDATE "{schema}".batch SET user_key = %s WHERE id = %s', ["poison-add", pb.id])
        pc = t.open_batch(c, user_key="fixture-poison-close", completion_topic="poison")
        t.add_items(c, pc, 3)
        t.close_batch(c, pc)
        pe = t.open_batch(c, user_key="fixture-poison-empty", completion_topic="poison")
        c.commit()
    return Fixture(ob, cb, pb, pc, pe)


def call(t: Any, op: str, session: Any, fx: Fixture, caller: Caller, *, poisoned: bool) -> Any:
    """The tracker call of `op` (a coroutine for the async tracker). Poisoned: a database trigger
    refuses a row the call writes after it has written others."""
    b = fx.open_batch.id
    if op == "open":
        return t.open_batch(session, user_key="poison-open" if poisoned else "new", completion_topic="done")
    if op == "open_child":
        # poisoned: the parent is counted, then the child's row is refused
        key = "poison-open" if poisoned else "child"
        return t.open_batch(session, user_key=key, parent=fx.open_batch, tolerated_failures=1)
    if op == "fail":
        if poisoned:  # failing every item finishes the batch, and its completion event is refused
            return t.fail(session, [f"{fx.poison_closed.id}:0:0-2"], "gave up")
        return t.fail(session, [f"{fx.closed_batch.id}:0:0", f"{b}:0:2"], "gave up")
    if op == "failures":
        return t.failures(session, 10**12 if poisoned else fx.closed_batch, limit=10)
    if op == "enqueue":
        target = fx.poison_batch if poisoned else fx.open_batch
        return t.enqueue(
            session, target, [b"x", {"n": 1}, "y"], topic="poison" if poisoned else "items", headers={"h": b"v"}
        )
    if op == "add_items":
        return t.add_items(session, fx.poison_batch if poisoned else fx.open_batch, 10_000)
    if op == "close":
        # poisoned: closing an empty batch completes it, and its completion event is refused
        return t.close_batch(session, fx.poison_empty if poisoned else fx.open_batch)
    if op == "ack":
        if poisoned:  # an ack that claims an item, then its claim of another batch's items is refused
            return t.ack(session, [f"{b}:0:0", f"{fx.poison_closed.id}:0:0-2"])
        return t.ack(session, [f"{fx.closed_batch.id}:0:0-2", f"{b}:0:1"])
    if op == "exactly_once":
        item = f"{fx.closed_batch.id}:0:1"

        def effect(_session: Any) -> Any:
            written = caller.write("effect")
            if not poisoned:
                return written
            if inspect.isawaitable(written):

                async def fail() -> None:
                    await written
                    await caller.raw.execute("SELECT 1 / 0")

                return fail()
            return caller.raw.execute("SELECT 1 / 0")

        return t.exactly_once(session, item, effect)
    if op == "status":
        return t.status(session, 10**12 if poisoned else b)
    raise AssertionError(op)


EXPECTED_ERROR: dict[str, tuple[type[BaseException], ...]] = {
    "status": (tracker.UnknownBatch,),
    "failures": (tracker.UnknownBatch,),
    "exactly_once": (psycopg.errors.DivisionByZero,),
}


def _committed(dsn: str, schema: str, extra: dict[str, Any] | None = None) -> tuple[dict, list]:
    with psycopg.connect(dsn, **(extra or {})) as c:
        return snapshot(c, schema), c.execute(f'SELECT tag FROM "{schema}".caller_rows ORDER BY tag').fetchall()


def _expected_tags(mode: str, op: str, outcome: str) -> list[str]:
    tags = ["after", "before"]
    if mode in ("autocommit_nested_block", "sa_begin_nested", "asyncpg_nested", "sa_asyncpg_begin_nested"):
        tags.append("outer")
    if op == "exactly_once" and outcome == "committed":
        tags.append("effect")
    return tags


# ---------------------------------------------------------------- the matrix


def _sync_cell(dsn: str, schema: str, mode: str, op: str, outcome: str, extra: dict[str, Any]) -> None:
    fx = _prepare(dsn, schema, extra)
    t = tracker.Tracker(schema=schema)
    before, _ = _committed(dsn, schema, extra)
    with sync_mode(mode, dsn, schema, outcome != "rolled_back", extra) as caller:
        if mode != "autocommit_off_idle":
            caller.write("before")
        if outcome == "failed":
            errors = EXPECTED_ERROR.get(op, (psycopg.errors.RaiseException,))
            with pytest.raises(errors):
                call(t, op, caller.session, fx, caller, poisoned=True)
        else:
            result = call(t, op, caller.session, fx, caller, poisoned=False)
            if op == "exactly_once":
                assert result.first_time
        if caller.transactional and mode not in ("pipeline", "pipeline_autocommit_block"):
            assert caller.raw.info.transaction_status == pq.TransactionStatus.INTRANS
        if caller.transactional:
            # Nothing of the call is visible outside the caller's transaction: it committed nothing.
            assert _committed(dsn, schema, extra)[0] == before
        elif outcome != "failed":
            assert caller.raw.info.transaction_status == pq.TransactionStatus.IDLE
        caller.write("after")  # the caller's transaction is usable after the call, failed or not
        if mode == "autocommit_off_idle":
            caller.write("before")
    after = _committed(dsn, schema, extra)
    _assert_outcome(mode, op, outcome, before, after, caller.transactional)


def _assert_outcome(
    mode: str, op: str, outcome: str, before: dict, after: tuple[dict, list], transactional: bool
) -> None:
    state, rows = after
    tags = sorted(t for (t,) in rows)
    if outcome == "rolled_back" and transactional:
        assert state == before, f"{mode}/{op}: the caller rolled back, yet the call's rows remain"
        assert tags == [], tags
        return
    expected = _expected_tags(mode, op, "committed" if outcome != "failed" else "failed")
    assert tags == sorted(expected), (mode, op, outcome, tags)
    if outcome == "failed":
        assert state == before, f"{mode}/{op}: a failed call left rows behind"
    elif op not in ("status", "failures"):
        assert state != before, f"{mode}/{op}: the call's work is missing after the caller committed"
    else:
        assert state == before


async def _async_cell(dsn: str, schema: str, mode: str, op: str, outcome: str, extra: dict[str, Any]) -> None:
    fx = _prepare(dsn, schema, extra)
    t = AsyncTracker(schema=schema)
    before, _ = _committed(dsn, schema, extra)
    async with async_mode(mode, dsn, schema, outcome != "rolled_back", extra) as caller:
        if mode != "autocommit_off_idle":
            await caller.write("before")
        if outcome == "failed":
            errors = EXPECTED_ERROR.get(op, (psycopg.errors.RaiseException,))
            if "asyncpg" in mode:
                import asyncpg

                errors = {
                    "status": (tracker.UnknownBatch,),
                    "failures": (tracker.UnknownBatch,),
                    "exactly_once": (asyncpg.exceptions.DivisionByZeroError,),
                }.get(op, (asyncpg.exceptions.RaiseError,))
            with pytest.raises(errors):
                await call(t, op, caller.session, fx, caller, poisoned=True)
        else:
            result = await call(t, op, caller.session, fx, caller, poisoned=False)
            if op == "exactly_once":
                assert result.first_time
        if caller.transactional and mode != "pipeline":
            assert in_transaction(caller.raw)
        if caller.transactional:
            assert _committed(dsn, schema, extra)[0] == before
        elif outcome != "failed":
            assert idle(caller.raw)
        await caller.write("after")
        if mode == "autocommit_off_idle":
            await caller.write("before")
    after = _committed(dsn, schema, extra)
    _assert_outcome(mode, op, outcome, before, after, caller.transactional)


OUTCOMES = ["committed", "rolled_back", "failed"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", SYNC_MODES)
def test_sync_face_keeps_the_callers_transaction(pg_dsn, poisoned, mode, op):
    for outcome in OUTCOMES:
        _sync_cell(pg_dsn, poisoned, mode, op, outcome, {})


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_async_face_keeps_the_callers_transaction(pg_dsn, poisoned, mode, op):
    for outcome in OUTCOMES:
        asyncio.run(_async_cell(pg_dsn, poisoned, mode, op, outcome, {}))
