"""The asyncio face on asyncpg: the same steps and transaction rules as `tracker.drivers.sync_psycopg`, on an
`asyncpg.Connection` (directly or behind a SQLAlchemy `AsyncSession` on postgresql+asyncpg://).

asyncpg has no autocommit switch: outside a transaction block every statement commits on its own.
So a call inside a transaction (`async with conn.transaction():`, or the one SQLAlchemy began) runs
in a savepoint of it; a call outside one is its own transaction. Statements are the core's, with
psycopg-style placeholders (`%s`, `%(name)s`) turned into asyncpg's `$n` once per statement text;
rows come back as tuples. asyncpg sends one statement per round trip (no pipeline), so a call may
cost a few more round trips than on psycopg.
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypeVar

from tracker.core.steps import Effect, Op, Params, Query, Round, Write
from tracker.drivers.sync_psycopg import OWN_TRANSACTION, SAVEPOINT, Boundary
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


async def _send(conn: asyncpg.Connection, queries: Iterable[Query]) -> list[object]:
    return [await _one(conn, q) for q in queries]


async def _chunks(step: Write) -> AsyncIterator[bytes]:
    for chunk in step.chunks():
        yield chunk


async def _write(conn: asyncpg.Connection, step: Write) -> None:
    await conn.copy_to_table(
        step.table, schema_name=step.schema, columns=list(step.columns), source=_chunks(step), format="binary"
    )


async def _start(conn: asyncpg.Connection, edge: Boundary) -> None:
    import asyncpg

    try:
        await conn.execute(edge.start)
    except asyncpg.exceptions.InFailedSQLTransactionError:
        raise CallerTransactionAborted() from None


async def run(conn: asyncpg.Connection, op: Op[T], *, effect: Callable[[], Awaitable[object]] | None = None) -> T:
    """Drive `op` to its result on `conn`, all or nothing inside the caller's transaction."""
    edge: Boundary = SAVEPOINT if conn.is_in_transaction() else OWN_TRANSACTION
    started = ended = False
    try:
        try:
            step = next(op)
        except StopIteration as done:  # nothing to send (e.g. an ack of no ids)
            return done.value
        while True:
            if isinstance(step, Round):
                if not started:
                    await _start(conn, edge)
                    started = True
                result: object = await _send(conn, step.queries)
                if step.last:
                    await conn.execute(edge.end)
                    ended = True
            elif isinstance(step, Write):
                if not started:
                    await _start(conn, edge)
                    started = True
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
                    await conn.execute(edge.end)
                return done.value
    except BaseException:
        op.close()
        if started and not ended and not conn.is_closed() and conn.is_in_transaction():
            for statement in edge.undo:
                await conn.execute(statement)
        raise
