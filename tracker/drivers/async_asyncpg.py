"""The asyncio face on asyncpg: the same steps, step loop (tracker/drivers/calls.py) and transaction
rules as `tracker.drivers.sync_psycopg`, on an `asyncpg.Connection` (directly or behind a
SQLAlchemy `AsyncSession` on postgresql+asyncpg://).

asyncpg has no autocommit switch: outside a transaction block every statement commits on its own.
So a call inside a transaction (`async with conn.transaction():`, or the one SQLAlchemy began) runs
in a savepoint of it; a call outside one is its own transaction. Statements are the core's, with
psycopg-style placeholders (`%s`, `%(name)s`) turned into asyncpg's `$n` once per statement text;
rows come back as tuples. asyncpg sends one statement per round trip (no pipeline), so a call may
cost a few more round trips than on psycopg. An interrupted call (a cancellation, a timeout) is
undone as sync_psycopg.py's docstring says: its work stands if its end had run.
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar

from tracker.core.steps import Op, Params, Query, Write
from tracker.drivers.calls import OWN_TRANSACTION, AsyncIo, Undo, drive_async, frame, inside, savepoint
from tracker.errors import CallerTransactionAborted

if TYPE_CHECKING:
    import asyncpg

T = TypeVar("T")
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%s|%%")


@functools.lru_cache(maxsize=256)
def translate(sql: str) -> tuple[str, tuple[str, ...] | int]:
    """(asyncpg SQL, the parameter names in $n order) for named placeholders, or (SQL, count) for
    positional ones. A name used twice gets one $n."""
    names: list[str] = []
    count = 0

    def sub(m: re.Match[str]) -> str:
        nonlocal count
        if m.group(0) == "%%":
            return "%"
        if m.group(1) is not None:
            if m.group(1) not in names:
                names.append(m.group(1))
            return f"${names.index(m.group(1)) + 1}"
        count += 1
        return f"${count}"

    text = _PLACEHOLDER.sub(sub, sql)
    if names and count:
        raise ValueError("a statement mixes named and positional placeholders")
    return text, (tuple(names) if names else count)


def _args(sql: str, params: Params) -> tuple[str, list[object]]:
    text, shape = translate(sql)
    if params is None:
        return text, []
    if isinstance(params, Mapping):
        assert isinstance(shape, tuple)
        return text, [params[name] for name in shape]
    return text, list(params)


async def _one(conn: asyncpg.Connection, q: Query) -> object:
    text, args = _args(q.sql, q.params)
    if q.fetch == "one":
        row = await conn.fetchrow(text, *args)
        return None if row is None else tuple(row)
    if q.fetch == "all":
        return [tuple(r) for r in await conn.fetch(text, *args)]
    await conn.execute(text, *args)
    return None


async def _send(conn: asyncpg.Connection, queries: Sequence[Query]) -> list[object]:
    return [await _one(conn, q) for q in queries]


async def _chunks(step: Write) -> AsyncIterator[bytes]:
    for chunk in step.chunks():
        yield chunk


async def _write(conn: asyncpg.Connection, step: Write) -> None:
    await conn.copy_to_table(
        step.table, schema_name=step.schema, columns=list(step.columns), source=_chunks(step), format="binary"
    )


async def _begin(conn: asyncpg.Connection, sql: str) -> None:
    import asyncpg

    try:
        await conn.execute(sql)
    except asyncpg.exceptions.InFailedSQLTransactionError:
        raise CallerTransactionAborted() from None


async def _undo(conn: asyncpg.Connection, undo: Undo) -> None:
    """Roll the call back to where it began. An interruption leaves no result pending: asyncpg asks
    the server to cancel the statement running and discards its results before the next statement.
    A call's own transaction is rolled back even if the connection does not look inside one: after
    a cancellation its status is the one before the cancelled statement (BEGIN) until the next
    statement, and a ROLLBACK outside a transaction changes nothing. A savepoint that may be gone
    (`Undo.unsure`) is rolled back to behind a probe; a probe refused since the transaction failed
    (inside the call's savepoint, so it is there) is not needed."""
    import asyncpg

    edge = undo.edge
    if conn.is_closed() or not (edge == OWN_TRANSACTION or conn.is_in_transaction()):
        return
    if undo.unsure and edge.savepoint is not None:
        try:
            await conn.execute(edge.probe)
        except asyncpg.exceptions.InFailedSQLTransactionError:
            pass
        else:
            rollback, release = edge.undo
            try:
                await conn.execute(rollback)
            except asyncpg.exceptions.InvalidSavepointSpecificationError:
                # The call's end ran: its work was released into the caller's transaction, and stands.
                for statement in edge.unprobe:
                    await conn.execute(statement)
                return
            await conn.execute(release)
            return
    for statement in edge.undo:
        await conn.execute(statement)


_IO: AsyncIo[asyncpg.Connection] = (_send, _write, _begin, _undo)


async def run(
    conn: asyncpg.Connection,
    op: Op[T],
    *,
    effect: Callable[[], Awaitable[object]] | None = None,
    within: str | None = None,
) -> T:
    """Drive `op` to its result on `conn`, all or nothing inside the caller's transaction (`within`:
    the call's name, when it must not be a transaction of its own: `calls.inside`)."""
    edge = inside(savepoint() if conn.is_in_transaction() else OWN_TRANSACTION, within)
    return await drive_async(frame(op, edge, pipelined=False), conn, _IO, effect)
