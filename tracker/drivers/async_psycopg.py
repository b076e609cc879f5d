"""The asyncio face's driver on psycopg: runs a core operation's steps on an `AsyncConnection`
(directly or behind a SQLAlchemy `AsyncSession`).

The region below is also the sync driver (tracker/drivers/sync_psycopg.py, generated from it by
deploy/async_to_sync.py); the transaction rules are in sync_psycopg.py's docstring and the step
loop in tracker/drivers/calls.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import psycopg
from psycopg import pq
from psycopg.generators import copy_end
from psycopg.rows import tuple_row

from tracker.core.steps import Op, Query, Write
from tracker.drivers.calls import AsyncIo, Undo, boundary, drive_async, frame, inside
from tracker.drivers.sync_psycopg import in_pipeline, in_transaction, usable
from tracker.errors import CallerTransactionAborted

T = TypeVar("T")


# <async psycopg>
async def _send(conn: psycopg.AsyncConnection, queries: Sequence[Query]) -> list[object]:
    if len(queries) == 1 and not in_pipeline(conn):
        cursors = [psycopg.AsyncCursor(conn, row_factory=tuple_row)]
        # A statement without parameters (a call's end, alone) is never prepared: each call's
        # savepoint has a name of its own, so it would only churn the prepared-statement cache.
        prepare = False if queries[0].params is None else None
        await cursors[0].execute(queries[0].sql, queries[0].params, prepare=prepare)
    else:
        async with conn.pipeline():
            cursors = []
            for q in queries:
                cur = psycopg.AsyncCursor(conn, row_factory=tuple_row)
                # Never prepared inside a pipeline: a statement that fails there skips the Parse of
                # the ones after it, and psycopg could then believe those prepared ("prepared statement
                # _pg3_N does not exist" later, in the caller's transaction).
                await cur.execute(q.sql, q.params, prepare=False)
                cursors.append(cur)
    out: list[object] = []
    for q, cur in zip(queries, cursors):
        if q.fetch == "one":
            out.append(await cur.fetchone())
        elif q.fetch == "all":
            out.append(await cur.fetchall())
        else:
            out.append(None)
    return out


async def _write(conn: psycopg.AsyncConnection, step: Write) -> None:
    cur = psycopg.AsyncCursor(conn, row_factory=tuple_row)
    if in_pipeline(conn):
        await cur.executemany(step.insert_sql, step.rows())
        return
    try:
        async with cur.copy(step.copy_sql) as copy:
            for chunk in step.chunks():
                await copy.write(chunk)
    except BaseException:
        if conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
            # Interrupted while the COPY began: psycopg read its reply but left the COPY open, the
            # server waiting for data (and every later statement for it). End it as failed, so the
            # call can be undone.
            try:
                await conn.wait(copy_end(conn.pgconn, b"interrupted"))
            except psycopg.Error:
                pass  # the failure this asks for
        raise


async def _begin(conn: psycopg.AsyncConnection, sql: str) -> None:
    await psycopg.AsyncCursor(conn).execute(sql, prepare=False)


async def _pipelined(conn: psycopg.AsyncConnection, statements: Sequence[str]) -> None:
    async with conn.pipeline():
        for statement in statements:
            await psycopg.AsyncCursor(conn).execute(statement, prepare=False)


async def _undo(conn: psycopg.AsyncConnection, undo: Undo) -> None:
    """Roll the call back to where it began. An interruption leaves no result pending: psycopg
    reads them all (after asking the server to cancel the statement running), so the connection is
    idle again. In pipeline mode the status is only true once the pipeline has synced (it reads
    ACTIVE while results are pending), so sync first. A savepoint that may be gone (`Undo.unsure`)
    is rolled back to behind a probe, unless the transaction failed inside it (so it is there)."""
    if not usable(conn):
        return
    if in_pipeline(conn):
        try:
            async with conn.pipeline():
                pass
        except psycopg.Error:
            pass  # the failure being undone, or one behind it: the status is true now
    if not in_transaction(conn):
        return
    edge = undo.edge
    if not undo.unsure or edge.savepoint is None or conn.info.transaction_status == pq.TransactionStatus.INERROR:
        await _pipelined(conn, edge.undo)
        return
    try:
        await _pipelined(conn, (edge.probe, *edge.undo))
    except psycopg.errors.InvalidSavepointSpecification:
        # The call's end ran: its work was released into the caller's transaction, and stands.
        await _pipelined(conn, edge.unprobe)


_IO: AsyncIo[psycopg.AsyncConnection] = (_send, _write, _begin, _undo)


async def run(
    conn: psycopg.AsyncConnection,
    op: Op[T],
    *,
    effect: Callable[[], Awaitable[object]] | None = None,
    within: str | None = None,
) -> T:
    """Drive `op` to its result on `conn`, all or nothing inside the caller's transaction (`within`:
    the call's name, when it must not be a transaction of its own: `calls.inside`)."""
    if in_pipeline(conn):
        try:
            async with conn.pipeline():  # nested: its exit syncs the caller's queued statements
                pass
        except psycopg.Error as exc:  # one of them failed: the caller's transaction is aborted
            # The status may still read ACTIVE while the pipeline's sync is unread; outside
            # autocommit a server error in the caller's statements has aborted its transaction.
            aborted = conn.info.transaction_status == pq.TransactionStatus.INERROR
            if aborted or (not conn.autocommit and exc.sqlstate is not None):
                raise CallerTransactionAborted() from exc
            raise
    edge = inside(boundary(conn.autocommit, conn.info.transaction_status), within)
    return await drive_async(frame(op, edge), conn, _IO, effect)


# </async psycopg>
