"""The asyncio face's driver: the same steps and the same transaction rules as `tracker.drivers.sync_psycopg`,
on a psycopg `AsyncConnection` (directly or behind a SQLAlchemy `AsyncSession`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import psycopg
from psycopg.rows import tuple_row

from tracker.core.steps import Effect, Op, Query, Round, Write
from tracker.drivers.sync_psycopg import Boundary, boundary, in_pipeline, in_transaction, usable

T = TypeVar("T")


async def _send(conn: psycopg.AsyncConnection, queries: tuple[Query, ...]) -> list[object]:
    if len(queries) == 1 and not in_pipeline(conn):
        cursors = [psycopg.AsyncCursor(conn, row_factory=tuple_row)]
        await cursors[0].execute(queries[0].sql, queries[0].params)
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
    async with cur.copy(step.copy_sql) as copy:
        for chunk in step.chunks():
            await copy.write(chunk)


async def run(conn: psycopg.AsyncConnection, op: Op[T], *, effect: Callable[[], Awaitable[object]] | None = None) -> T:
    """Drive `op` to its result on `conn`, all or nothing inside the caller's transaction."""
    if in_pipeline(conn):
        async with conn.pipeline():  # nested: its exit syncs the caller's queued statements
            pass
    edge = boundary(conn.autocommit, conn.info.transaction_status)
    started = ended = False
    try:
        try:
            step = next(op)
        except StopIteration as done:  # nothing to send (e.g. an ack of no ids)
            return done.value
        while True:
            if isinstance(step, Round):
                prefix = () if started else (Query(edge.start),)
                suffix = (Query(edge.end),) if step.last else ()
                started = True
                results = await _send(conn, prefix + step.queries + suffix)
                ended = step.last
                result: object = results[len(prefix) : len(prefix) + len(step.queries)]
            elif isinstance(step, Write):
                if not started:
                    started = True
                    await _send(conn, (Query(edge.start),))
                await _write(conn, step)
                result = None
            elif isinstance(step, Effect):
                if effect is None:
                    raise RuntimeError("the operation asked for an effect but none was given")
                result = await effect()
            else:  # pragma: no cover - the core yields only the steps above
                raise TypeError(f"unknown step {step!r}")
            try:
                step = op.send(result)
            except StopIteration as done:
                if started and not ended:
                    await _send(conn, (Query(edge.end),))
                return done.value
    except BaseException:
        op.close()
        if started and not ended:
            await _undo(conn, edge)
        raise


async def _undo(conn: psycopg.AsyncConnection, edge: Boundary) -> None:
    """See tracker.drivers.sync_psycopg._undo."""
    if not usable(conn):
        return
    if in_pipeline(conn):
        try:
            async with conn.pipeline():
                pass
        except psycopg.Error:
            pass
    if not in_transaction(conn):
        return
    async with conn.pipeline():
        for statement in edge.undo:
            await psycopg.AsyncCursor(conn).execute(statement)
