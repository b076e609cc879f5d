"""Calls interrupted at the edge of their boundary, and callers whose transaction already failed.

- asyncio cancellation landing on the statement that begins a call's own transaction (asyncpg, no
  transaction block: each call is its own transaction): the connection must not be left inside a
  transaction nobody will end, where the caller's later "autocommit" statements would never commit;
- a caller in pipeline mode whose queued statement failed: the call raises
  CallerTransactionAborted (the caller's own error is its cause) and sends nothing;
- a call (in the caller's transaction) interrupted once the round carrying its end ran, directly or
  nested in another call's effect: the interruption is raised, the call's work stands, the caller's
  transaction stays usable, and an outer call's savepoint is never touched.
"""

from __future__ import annotations

import asyncio

import asyncpg
import psycopg
import pytest
from psycopg import pq
from test_tracker_support import snapshot

import tracker
from tracker.aio import AsyncTracker


class CancelAtBegin:
    """Patches asyncpg's `Connection.execute` to cancel the task running a call when the call's
    BEGIN is sent: `in_flight`, while the server has it (the reply not read yet); otherwise just
    after it ran."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.arm: str | None = None
        real = asyncpg.Connection.execute

        async def execute(conn: asyncpg.Connection, query: str, *args: object, **kwargs: object) -> str:
            mode = self.arm
            if mode is None or query != "BEGIN":
                return await real(conn, query, *args, **kwargs)
            self.arm = None
            task = asyncio.current_task()
            assert task is not None
            if mode == "in_flight":
                asyncio.get_running_loop().call_soon(task.cancel)
                return await real(conn, query)
            status = await real(conn, query)
            task.cancel()
            await asyncio.sleep(0)  # the cancellation lands here: the BEGIN has run
            return status

        monkeypatch.setattr(asyncpg.Connection, "execute", execute)


@pytest.mark.parametrize("when", ["in_flight", "after"])
def test_asyncpg_cancelled_at_begin_leaves_no_transaction_open(pg_dsn, schema, monkeypatch, when):
    t = AsyncTracker(schema=schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        before = snapshot(c, schema)
    cancel = CancelAtBegin(monkeypatch)

    async def main() -> bool:
        conn = await asyncpg.connect(pg_dsn)
        try:
            cancel.arm = when
            with pytest.raises(asyncio.CancelledError):
                await t.open_batch(conn, user_key="cancelled")
            assert cancel.arm is None  # the cancellation did land on the BEGIN
            await conn.execute("SELECT 1")  # the connection is usable
            # no transaction block: this commits at once, as the caller expects
            await conn.execute(f'INSERT INTO "{schema}".caller_rows VALUES ($1)', "after")
            return conn.is_in_transaction()
        finally:
            await conn.close()

    left_open = asyncio.run(main())
    with psycopg.connect(pg_dsn) as c:
        assert snapshot(c, schema) == before
        assert c.execute(f'SELECT tag FROM "{schema}".caller_rows').fetchall() == [("after",)]
    assert not left_open, "the cancelled call left the connection inside a transaction of its own"


class MyConnection(asyncpg.Connection):
    """An application's own connection class (asyncpg.connect(connection_class=...))."""


def test_a_subclass_of_asyncpg_connection_is_an_asyncpg_connection(pg_dsn, schema):
    t = AsyncTracker(schema=schema)

    async def main() -> None:
        conn = await asyncpg.connect(pg_dsn, connection_class=MyConnection)
        try:
            async with conn.transaction():
                batch = await t.open_batch(conn, user_key="subclass")
                assert (await t.status(conn, batch)).state == "open"
        finally:
            await conn.close()

    asyncio.run(main())


def _caller_rows(pg_dsn: str, schema: str) -> list[tuple]:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT tag FROM "{schema}".caller_rows').fetchall()


def test_sync_pipeline_with_a_failed_queued_statement_is_an_aborted_caller(pg_dsn, schema):
    t = tracker.Tracker(schema=schema)
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        c.commit()
        before = snapshot(c, schema)
        with c.pipeline():
            c.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["before"])
            c.execute("SELECT 1 / 0")  # queued: the caller has not read its result yet
            with pytest.raises(tracker.CallerTransactionAborted) as caught:
                t.open_batch(c, user_key="never")
            assert isinstance(caught.value.__cause__, psycopg.errors.DivisionByZero)
        assert c.info.transaction_status == pq.TransactionStatus.INERROR
        c.rollback()
        assert snapshot(c, schema) == before
    assert _caller_rows(pg_dsn, schema) == []


def test_async_pipeline_with_a_failed_queued_statement_is_an_aborted_caller(pg_dsn, schema):
    t = AsyncTracker(schema=schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        before = snapshot(c, schema)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as c:
            async with c.pipeline():
                await c.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["before"])
                await c.execute("SELECT 1 / 0")
                with pytest.raises(tracker.CallerTransactionAborted) as caught:
                    await t.open_batch(c, user_key="never")
                assert isinstance(caught.value.__cause__, psycopg.errors.DivisionByZero)
            assert c.info.transaction_status == pq.TransactionStatus.INERROR
            await c.rollback()

    asyncio.run(main())
    with psycopg.connect(pg_dsn) as c:
        assert snapshot(c, schema) == before
    assert _caller_rows(pg_dsn, schema) == []


# ---------------------------------------------------------------- cancelled once the call's end ran


def _cancel_after_release(monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """The task running a call is cancelled just after the round carrying the call's end (RELEASE
    SAVEPOINT) ran on the server, before the call could see its results: the window a timeout or
    a task group's cancellation hits whenever it lands as the reply arrives."""

    def ends(sql: str) -> bool:
        return sql.startswith("RELEASE SAVEPOINT")

    if driver == "asyncpg":
        real = asyncpg.Connection.execute

        async def execute(conn: asyncpg.Connection, query: str, *args: object, **kwargs: object) -> str:
            status = await real(conn, query, *args, **kwargs)
            if ends(query):
                monkeypatch.setattr(asyncpg.Connection, "execute", real)
                asyncio.current_task().cancel()  # type: ignore[union-attr]
                await asyncio.sleep(0)
            return status

        monkeypatch.setattr(asyncpg.Connection, "execute", execute)
        return
    from tracker.drivers import async_psycopg

    send, *rest = async_psycopg._IO

    async def cancelling_send(conn: psycopg.AsyncConnection, queries: tuple) -> list[object]:
        results = await send(conn, queries)
        if any(ends(q.sql) for q in queries):
            monkeypatch.setattr(async_psycopg, "_IO", (send, *rest))
            asyncio.current_task().cancel()  # type: ignore[union-attr]
            await asyncio.sleep(0)
        return results

    monkeypatch.setattr(async_psycopg, "_IO", (cancelling_send, *rest))


async def _cancelled_in_a_transaction(pg_dsn: str, schema: str, driver: str) -> tuple[BaseException, bool]:
    """(what the cancelled call raised, whether the caller's transaction could go on and commit)."""
    t = AsyncTracker(schema=schema)
    if driver == "asyncpg":
        conn = await asyncpg.connect(pg_dsn)
        tr = conn.transaction()
        await tr.start()
        own = f'INSERT INTO "{schema}".caller_rows VALUES ($1)'
        write = lambda tag: conn.execute(own, tag)  # noqa: E731
        commit, close = tr.commit, conn.close
    else:
        conn = await psycopg.AsyncConnection.connect(pg_dsn)
        own = f'INSERT INTO "{schema}".caller_rows VALUES (%s)'
        write = lambda tag: conn.execute(own, [tag])  # noqa: E731
        commit, close = conn.commit, conn.close
    try:
        await write("before")
        try:
            await t.open_batch(conn, user_key="cancelled")
            raised: BaseException = AssertionError("the call was not cancelled")
        except BaseException as exc:
            raised = exc
        try:
            await write("after")
            await commit()
            usable = True
        except Exception:
            usable = False
        return raised, usable
    finally:
        await close()


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_a_call_cancelled_after_its_end_ran_raises_the_cancellation(pg_dsn, schema, monkeypatch, driver):
    """Not the error of undoing a savepoint already released (InvalidSavepointSpecification): the
    task must still see its cancellation (asyncio.timeout, task groups rely on it)."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
    _cancel_after_release(monkeypatch, driver)
    raised, _usable = asyncio.run(_cancelled_in_a_transaction(pg_dsn, schema, driver))
    assert isinstance(raised, asyncio.CancelledError), repr(raised)


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_a_call_cancelled_after_its_end_ran_leaves_the_callers_transaction_usable(pg_dsn, schema, monkeypatch, driver):
    """The call completed inside the caller's transaction (its savepoint released): its work stands,
    like that of a statement of the caller's whose reply the cancellation kept from being read."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        before = snapshot(c, schema)
    _cancel_after_release(monkeypatch, driver)
    _raised, usable = asyncio.run(_cancelled_in_a_transaction(pg_dsn, schema, driver))
    assert usable
    assert _caller_rows(pg_dsn, schema) == [("before",), ("after",)]
    with psycopg.connect(pg_dsn) as c:
        batches = c.execute(f'SELECT user_key FROM "{schema}".batch').fetchall()
        assert batches == [("cancelled",)], snapshot(c, schema) | {"before": before}


def test_a_sync_call_interrupted_after_its_end_ran_raises_it_and_leaves_the_transaction_usable(
    pg_dsn, schema, monkeypatch
):
    """Ctrl-C (KeyboardInterrupt) landing once the round carrying the call's end ran."""
    from tracker.drivers import sync_psycopg

    send, *rest = sync_psycopg._IO

    def interrupted_send(conn: psycopg.Connection, queries: tuple) -> list[object]:
        results = send(conn, queries)
        if any(q.sql.startswith("RELEASE SAVEPOINT") for q in queries):
            monkeypatch.setattr(sync_psycopg, "_IO", (send, *rest))
            raise KeyboardInterrupt
        return results

    monkeypatch.setattr(sync_psycopg, "_IO", (interrupted_send, *rest))
    t = tracker.Tracker(schema=schema)
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        c.commit()
        c.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["before"])
        with pytest.raises(KeyboardInterrupt):
            t.open_batch(c, user_key="interrupted")
        assert c.info.transaction_status == pq.TransactionStatus.INTRANS
        c.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["after"])
        c.commit()
        assert c.execute(f'SELECT user_key FROM "{schema}".batch').fetchall() == [("interrupted",)]
    assert _caller_rows(pg_dsn, schema) == [("before",), ("after",)]


@pytest.mark.parametrize("driver", ["psycopg", "asyncpg"])
def test_a_timed_out_call_inside_an_exactly_once_effect_leaves_the_outer_call_alone(
    pg_dsn, schema, monkeypatch, driver
):
    """A tracker call nested in another's effect, timed out (asyncio.timeout) once its end ran; the
    effect handles the timeout and goes on. Undoing the inner call must not touch the outer call's
    savepoint (rolling back to it would undo the ack and release it under the outer call's feet):
    the inner call's work stands, the outer call completes, and both commit with the caller."""
    t = AsyncTracker(schema=schema)
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        batch = tracker.open_batch(c, schema=schema)
        (h,) = tracker.add_items(c, batch, 2, schema=schema)
        c.commit()
    item = h.item_ids[0]
    timeouts: list[asyncio.Timeout] = []

    def ends(sql: str) -> bool:
        return sql.startswith("RELEASE SAVEPOINT") and bool(timeouts)

    async def time_out() -> None:
        timeouts.pop().reschedule(asyncio.get_running_loop().time())
        await asyncio.sleep(0)  # the timeout's cancellation lands here: the inner call's end ran

    if driver == "asyncpg":
        real = asyncpg.Connection.execute

        async def execute(conn: asyncpg.Connection, query: str, *args: object, **kwargs: object) -> str:
            status = await real(conn, query, *args, **kwargs)
            if ends(query):
                await time_out()
            return status

        monkeypatch.setattr(asyncpg.Connection, "execute", execute)
    else:
        from tracker.drivers import async_psycopg

        send, *rest = async_psycopg._IO

        async def timing_out_send(conn: psycopg.AsyncConnection, queries: tuple) -> list[object]:
            results = await send(conn, queries)
            if any(ends(q.sql) for q in queries):
                await time_out()
            return results

        monkeypatch.setattr(async_psycopg, "_IO", (timing_out_send, *rest))

    async def effect(session: object) -> str:
        try:
            async with asyncio.timeout(None) as cm:
                timeouts.append(cm)
                await t.enqueue(session, batch, [b"inner"], topic="inner")
        except TimeoutError:
            return "timed out"
        return "not timed out"

    async def main() -> tuple[bool, str, bool]:
        if driver == "asyncpg":
            conn = await asyncpg.connect(pg_dsn)
            tr = conn.transaction()
            await tr.start()
            commit, close = tr.commit, conn.close
            await conn.execute(f'INSERT INTO "{schema}".caller_rows VALUES ($1)', "before")
        else:
            conn = await psycopg.AsyncConnection.connect(pg_dsn)
            commit, close = conn.commit, conn.close
            await conn.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["before"])
        try:
            done = await t.exactly_once(conn, item, effect)
            await commit()  # the caller's transaction is usable
            again = await t.exactly_once(conn, item, effect)
            return done.first_time, done.value, again.first_time
        finally:
            await close()

    first_time, value, again = asyncio.run(main())
    assert (first_time, value, again) == (True, "timed out", False)
    assert _caller_rows(pg_dsn, schema) == [("before",)]
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT count(*) FROM "{schema}".outbox WHERE topic = %s', ["inner"]).fetchone() == (1,)


def test_a_call_interrupted_as_its_copy_began_leaves_no_copy_open(pg_dsn, schema, monkeypatch):
    """psycopg, interrupted while a COPY starts, reads the server's reply but leaves the COPY open
    (the server waiting for data): the call must end it, or the caller's next statement hangs."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def copy(cur: psycopg.AsyncCursor, statement: str, params: object = None, **kwargs: object):
        await cur._conn.wait(cur._start_copy_gen(statement, params))
        monkeypatch.undo()
        raise asyncio.CancelledError  # as psycopg raises a cancellation landing in that wait
        yield  # pragma: no cover

    t = AsyncTracker(schema=schema)
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'CREATE TABLE "{schema}".caller_rows (tag text)')
        batch = tracker.open_batch(c, schema=schema)
        c.commit()
        before = snapshot(c, schema)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
            await conn.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["before"])
            monkeypatch.setattr(psycopg.AsyncCursor, "copy", copy)
            with pytest.raises(asyncio.CancelledError):
                await t.enqueue(conn, batch, [b"x"], topic="t")
            async with asyncio.timeout(10):
                await conn.execute(f'INSERT INTO "{schema}".caller_rows VALUES (%s)', ["after"])
                await conn.commit()

    asyncio.run(main())
    assert _caller_rows(pg_dsn, schema) == [("before",), ("after",)]
    with psycopg.connect(pg_dsn) as c:
        assert snapshot(c, schema) == before
