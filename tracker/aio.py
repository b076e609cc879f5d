"""The asyncio face: `AsyncTracker`, the same API as `Tracker` with `await`, on a psycopg
`AsyncConnection`, an asyncpg `Connection`, or a SQLAlchemy `AsyncSession`/`AsyncConnection`
(postgresql+psycopg:// or postgresql+asyncpg:// engine).

    from tracker import aio

    async def handler(session: AsyncSession):
        batch = await aio.open_batch(session, user_key="catalog-42")
        await aio.enqueue(session, batch, items, topic="process-item")
        await aio.close_batch(session, batch)
        await session.commit()

Module-level functions use a default `AsyncTracker()` (schema "reaper"); build your own
`AsyncTracker(schema=..., outbox_table=..., completion_topic=...)` for anything else.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import psycopg

from tracker.config import DEFAULT_SCHEMA
from tracker.consumer import Processed
from tracker.core.acks import AckResult
from tracker.core.batches import Batch, BatchStatus, GroupHandle
from tracker.core.operations import ItemIds, TrackerCore
from tracker.core.steps import Op
from tracker.core.validate import id_list
from tracker.drivers import async_asyncpg as apgdriver
from tracker.drivers import async_psycopg as adriver
from tracker.drivers.connections import AsyncSession, async_connection
from tracker.ids import GroupMask, fold
from tracker.outbox import Headers, KeyArg

# Acks of up to this many entries fold on the event loop (well under a millisecond); larger ones in
# a thread.
_FOLD_ON_LOOP_MAX = 2000

T = TypeVar("T")
AsyncEffect = Callable[[AsyncSession], Awaitable[T] | T]


async def _run(session: AsyncSession, op: Op[T], effect: Callable[[], Awaitable[object]] | None = None) -> T:
    conn = await async_connection(session)
    if isinstance(conn, psycopg.AsyncConnection):
        return await adriver.run(conn, op, effect=effect)
    return await apgdriver.run(conn, op, effect=effect)


class AsyncTracker(TrackerCore):
    """Fan-out tracking for one schema and outbox table, for asyncio. Holds no connection."""

    async def open_batch(
        self, session: AsyncSession, *, user_key: str | None = None, completion_topic: str | None = None
    ) -> Batch:
        op = self._open_op(user_key, completion_topic)
        batch = await _run(session, op)
        self._count_open()
        return batch

    async def add_items(self, session: AsyncSession, batch: Batch | int, n: int) -> list[GroupHandle]:
        op = self._add_op(batch, n)
        return await _run(session, op)

    async def enqueue(
        self,
        session: AsyncSession,
        batch: Batch | int,
        items: object,
        *,
        topic: str,
        key: KeyArg = None,
        headers: Headers = None,
    ) -> list[GroupHandle]:
        op = self._enqueue_op(batch, items, topic, key, headers)
        return await _run(session, op)

    async def close_batch(self, session: AsyncSession, batch: Batch | int) -> bool:
        op = self._close_op(batch)
        complete, closed_now = await _run(session, op)
        self._count_close(complete, closed_now)
        return complete

    async def status(self, session: AsyncSession, batch: Batch | int) -> BatchStatus:
        return await _run(session, self._status_op(batch))

    async def ack(self, session: AsyncSession, item_ids: ItemIds, *, claims: bool = True) -> AckResult:
        """`Tracker.ack` for asyncio (claims, or with claims=False the masked path)."""
        started = time.perf_counter()
        entries = id_list(item_ids)
        # Folding a large ack is CPU work: done in a thread, so it never holds up the event loop.
        masks = await asyncio.to_thread(fold, entries) if len(entries) > _FOLD_ON_LOOP_MAX else fold(entries)
        op = self._ack_folded_op(entries, masks, claims)
        result = await _run(session, op)
        self._count_ack(result, started)
        return result

    async def apply_masks(
        self,
        session: AsyncSession,
        masks: Mapping[tuple[int, int], GroupMask],
        *,
        reject_invalid: bool = False,
        skip_locked: bool = False,
    ) -> AckResult:
        started = time.perf_counter()
        op = self._apply_op(masks, reject_invalid, skip_locked)
        result = await _run(session, op)
        self._count_ack(result, started)
        return result

    async def exactly_once(self, session: AsyncSession, item_id: str | bytes, effect: AsyncEffect[T]) -> Processed[T]:
        """`Tracker.exactly_once` for asyncio: `effect(session)` may be a coroutine function."""
        started = time.perf_counter()

        async def run_effect() -> object:
            value = effect(session)
            return await value if inspect.isawaitable(value) else value

        op = self._exactly_once_op(item_id)
        result = await _run(session, op, effect=run_effect)
        self._count_ack(result.ack, started)
        return result  # type: ignore[return-value]


@functools.lru_cache(maxsize=32)
def default(schema: str | None = None) -> AsyncTracker:
    """The default AsyncTracker of a schema (outbox table "outbox", topic "batch-completions")."""
    return AsyncTracker(schema=schema or DEFAULT_SCHEMA)


async def open_batch(
    session: AsyncSession,
    *,
    user_key: str | None = None,
    completion_topic: str | None = None,
    schema: str | None = None,
) -> Batch:
    return await default(schema).open_batch(session, user_key=user_key, completion_topic=completion_topic)


async def add_items(
    session: AsyncSession, batch: Batch | int, n: int, *, schema: str | None = None
) -> list[GroupHandle]:
    return await default(schema).add_items(session, batch, n)


async def enqueue(
    session: AsyncSession,
    batch: Batch | int,
    items: object,
    *,
    topic: str,
    key: KeyArg = None,
    headers: Headers = None,
    schema: str | None = None,
) -> list[GroupHandle]:
    return await default(schema).enqueue(session, batch, items, topic=topic, key=key, headers=headers)


async def close_batch(session: AsyncSession, batch: Batch | int, *, schema: str | None = None) -> bool:
    return await default(schema).close_batch(session, batch)


async def status(session: AsyncSession, batch: Batch | int, *, schema: str | None = None) -> BatchStatus:
    return await default(schema).status(session, batch)


async def ack(session: AsyncSession, item_ids: ItemIds, *, schema: str | None = None, claims: bool = True) -> AckResult:
    return await default(schema).ack(session, item_ids, claims=claims)


async def apply_masks(
    session: AsyncSession,
    masks: Mapping[tuple[int, int], GroupMask],
    *,
    schema: str | None = None,
    reject_invalid: bool = False,
) -> AckResult:
    return await default(schema).apply_masks(session, masks, reject_invalid=reject_invalid)


async def exactly_once(
    session: AsyncSession, item_id: str | bytes, effect: AsyncEffect[T], *, schema: str | None = None
) -> Processed[T]:
    return await default(schema).exactly_once(session, item_id, effect)


__all__ = [
    "AsyncTracker",
    "default",
    "open_batch",
    "add_items",
    "enqueue",
    "close_batch",
    "status",
    "ack",
    "apply_masks",
    "exactly_once",
]
