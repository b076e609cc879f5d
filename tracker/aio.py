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

The region marked below is also the sync face (tracker/sync.py is generated from it by
deploy/async_to_sync.py): methods, parameters and docstrings are written once, here. What differs
between the faces is written by hand above the region in each file.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

import psycopg

from tracker.config import DEFAULT_SCHEMA
from tracker.core.acks import AckResult, FailResult, FailurePage, Processed
from tracker.core.batches import Batch, BatchStatus, GroupHandle
from tracker.core.enqueue import Headers, KeyArg
from tracker.core.operations import ItemIds, TrackerCore
from tracker.core.steps import Op
from tracker.core.validate import check_reason, id_list
from tracker.drivers import async_asyncpg as apgdriver
from tracker.drivers import async_psycopg as adriver
from tracker.drivers.connections import AsyncSession, async_connection
from tracker.ids import GroupMask, fold

# Acks of up to this many entries fold on the event loop (well under a millisecond); larger ones in
# a thread.
_FOLD_ON_LOOP_MAX = 2000

T = TypeVar("T")
AsyncEffect = Callable[[AsyncSession], Awaitable[T] | T]


async def _run(
    session: AsyncSession,
    op: Op[T],
    effect: Callable[[], Awaitable[object]] | None = None,
    within: str | None = None,
) -> T:
    conn = await async_connection(session)
    if isinstance(conn, psycopg.AsyncConnection):
        return await adriver.run(conn, op, effect=effect, within=within)
    return await apgdriver.run(conn, op, effect=effect, within=within)


async def _fold(entries: list[str | bytes]) -> dict[tuple[int, int], GroupMask]:
    # Folding a large ack is CPU work: done in a thread, so it never holds up the event loop.
    return await asyncio.to_thread(fold, entries) if len(entries) > _FOLD_ON_LOOP_MAX else fold(entries)


def _effect_call(effect: AsyncEffect[T], session: AsyncSession) -> Callable[[], Awaitable[object]]:
    """`effect(session)`, awaited if it returns an awaitable (a coroutine function)."""

    async def call() -> object:
        value = effect(session)
        return await value if inspect.isawaitable(value) else value

    return call


# <async face>
class AsyncTracker(TrackerCore):
    """Fan-out tracking for one schema and outbox table. Holds no connection: one tracker serves
    every session (and thread)."""

    async def open_batch(
        self,
        session: AsyncSession,
        *,
        user_key: str | None = None,
        completion_topic: str | None = None,
        parent: Batch | int | None = None,
        tolerated_failures: int | None = None,
        tolerated_failure_ratio: float | None = None,
    ) -> Batch:
        """Open a batch. Items are added by `enqueue` or `add_items`; `close_batch` closes it.
        `user_key` comes back in the completion event; `completion_topic` overrides the tracker's.

        `parent`: open it as a child of that open batch (ParentNotOpen when it is closed, complete
        or expired; DepthExceeded below 8 levels); the parent finishes only after its children.
        `tolerated_failures` / `tolerated_failure_ratio`: the batch finishes early, as failed, once
        more items failed than that many, or (closed) than that fraction of its items; with its
        children's roll-up. Without them it waits for every item."""
        op = self._open_op(user_key, completion_topic, parent, tolerated_failures, tolerated_failure_ratio)
        batch = await _run(session, op)
        self._count_open()
        return batch

    async def add_items(self, session: AsyncSession, batch: Batch | int, n: int) -> list[GroupHandle]:
        """Track `n` items without writing messages (for producers that publish elsewhere).
        Returns the groups holding them, in item order."""
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
        """Write one outbox message per item on `topic` and track the items in `batch`.

        Items are bytes, str, JSON-serialisable values, or `Message(value, key=, headers=)` for a
        per-item key and headers. `key` is the default key (or a function of the item giving it);
        `headers` are added to every message. Returns the groups holding the items, in item order.
        """
        op = self._enqueue_op(batch, items, topic, key, headers)
        return await _run(session, op)

    async def close_batch(self, session: AsyncSession, batch: Batch | int) -> bool:
        """Close the batch: no more items. Returns whether it is complete (now or already).
        Closing a closed or complete batch changes nothing; an expired one raises BatchExpired."""
        op = self._close_op(batch)
        complete, closed_now = await _run(session, op)
        self._count_close(complete, closed_now)
        return complete

    async def status(self, session: AsyncSession, batch: Batch | int) -> BatchStatus:
        """The batch's state and counts, as this transaction sees them."""
        return await _run(session, self._status_op(batch))

    async def ack(self, session: AsyncSession, item_ids: ItemIds, *, claims: bool = True) -> AckResult:
        """Ack item ids (and runs '<b>:<g>:<start>-<end>') in the caller's transaction, as claims
        (tracker/core/acks.py): no batch lock is held; bits, counts and completion change at commit.
        A call of more than `tracker.core.acks.CLAIMS_PER_CALL_MAX` (1000) ids is a bulk ack: masked
        updates under the batch row locks, applied at once, `completed` filled. `claims=False`
        takes that path for any call: for a short transaction of your own (a request handler that
        commits at once) that wants `completed` reported exactly; it holds the acked batches' row
        locks until you commit.

        Raises MalformedItemId, UnknownBatch, UnknownGroup, IndexOutOfRange or BatchExpired naming
        the offending entry as written; then nothing of the call was applied.
        """
        started = time.perf_counter()
        entries = id_list(item_ids)
        op = self._ack_op(entries, await _fold(entries), claims)
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
        """Apply folded masks (`tracker.fold`): bulk acks. reject_invalid=True leaves out unknown
        batches/groups and out-of-range indexes and returns them in `rejected`. Locks the named
        batch rows until the caller commits (for short transactions: the acker, Spark);
        skip_locked=True returns the masks of batches held elsewhere in `skipped` instead."""
        started = time.perf_counter()
        op = self._apply_op(masks, reject_invalid, skip_locked)
        result = await _run(session, op)
        self._count_ack(result, started)
        return result

    async def fail(self, session: AsyncSession, item_ids: ItemIds, reason: str) -> FailResult:
        """Record item ids (and runs) as failed under `reason` (1 to 500 characters, stored once
        however many items share it), in the caller's transaction. The first outcome recorded for an
        item wins: a later ack or failure of it is a duplicate, so record a failure only when you
        give up on the item. Takes the masked path: the named batches' rows stay locked until you
        commit, and `completed` lists the batches this call finished (last item, or a threshold).

        Raises MalformedItemId, UnknownBatch, UnknownGroup, IndexOutOfRange or BatchExpired naming
        the offending entry as written, InvalidValue for a reason too long or empty; then nothing
        of the call was applied.
        """
        checked = check_reason(reason)
        entries = id_list(item_ids)
        result = await _run(session, self._fail_op(entries, await _fold(entries), checked))
        self._count_completed(len(result.completed))
        return result

    async def fail_masks(
        self,
        session: AsyncSession,
        masks: Mapping[tuple[int, int], GroupMask],
        reason: str,
        *,
        reject_invalid: bool = False,
        skip_locked: bool = False,
    ) -> AckResult:
        """Record folded masks (`tracker.fold`) as failed under `reason` (checked as `fail` checks
        it): `fail` for callers that fold themselves (the acker), with `apply_masks`' options and
        result, `acked` counting the items this call failed. Locks the named batch rows until the
        caller commits."""
        checked = check_reason(reason)
        result = await _run(session, self._apply_op(masks, reject_invalid, skip_locked, checked))
        self._count_completed(len(result.completed))
        return result

    async def apply_outcomes(
        self,
        session: AsyncSession,
        steps: Sequence[tuple[str | None, Mapping[tuple[int, int], GroupMask]]],
        *,
        reject_invalid: bool = False,
        skip_locked: bool = False,
    ) -> list[AckResult]:
        """`apply_masks` (reason None) and `fail_masks` (a reason, checked as `fail` checks it) of
        each (reason, masks) step, in order, in two round trips whatever the number of steps: the
        named batches are locked at once, so with skip_locked=True a batch held elsewhere is
        skipped in every step. A result per step, as those calls return it."""
        started = time.perf_counter()
        results = await _run(session, self._apply_steps_op(steps, reject_invalid, skip_locked))
        self._count_acks(steps, results, started)
        return results

    async def failures(
        self, session: AsyncSession, batch: Batch | int, *, after: str | None = None, limit: int = 100
    ) -> FailurePage:
        """A page of the batch's failed items with their reasons, in item order: at most `limit`
        (1 to 1000) after the item id `after` (a previous page's `next`; None: from the start)."""
        return await _run(session, self._failures_op(batch, after, limit))

    async def exactly_once(self, session: AsyncSession, item_id: str | bytes, effect: AsyncEffect[T]) -> Processed[T]:
        """Ack `item_id` and, only if its bit was still set, run `effect(session)`, all in one
        savepoint of the caller's transaction: the effect and the ack commit or roll back together.
        A redelivery of a processed item returns first_time=False and does not run the effect.
        On the asyncio face `effect` may be a coroutine function."""
        started = time.perf_counter()
        op = self._exactly_once_op(item_id)
        result = await _run(session, op, effect=_effect_call(effect, session))
        self._count_ack(result.ack, started)
        return result  # type: ignore[return-value]


@functools.lru_cache(maxsize=32)
def default(schema: str | None = None) -> AsyncTracker:
    """The default AsyncTracker of a schema (outbox table "outbox", topic "batch-completions"): what
    the module-level functions use. For anything else build your own AsyncTracker and call its methods."""
    return AsyncTracker(schema=schema or DEFAULT_SCHEMA)


async def open_batch(
    session: AsyncSession,
    *,
    user_key: str | None = None,
    completion_topic: str | None = None,
    parent: Batch | int | None = None,
    tolerated_failures: int | None = None,
    tolerated_failure_ratio: float | None = None,
    schema: str | None = None,
) -> Batch:
    """`AsyncTracker.open_batch` on the default tracker of `schema`."""
    return await default(schema).open_batch(
        session,
        user_key=user_key,
        completion_topic=completion_topic,
        parent=parent,
        tolerated_failures=tolerated_failures,
        tolerated_failure_ratio=tolerated_failure_ratio,
    )


async def add_items(
    session: AsyncSession, batch: Batch | int, n: int, *, schema: str | None = None
) -> list[GroupHandle]:
    """`AsyncTracker.add_items` on the default tracker of `schema`."""
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
    """`AsyncTracker.enqueue` on the default tracker of `schema`."""
    return await default(schema).enqueue(session, batch, items, topic=topic, key=key, headers=headers)


async def close_batch(session: AsyncSession, batch: Batch | int, *, schema: str | None = None) -> bool:
    """`AsyncTracker.close_batch` on the default tracker of `schema`."""
    return await default(schema).close_batch(session, batch)


async def status(session: AsyncSession, batch: Batch | int, *, schema: str | None = None) -> BatchStatus:
    """`AsyncTracker.status` on the default tracker of `schema`."""
    return await default(schema).status(session, batch)


async def ack(session: AsyncSession, item_ids: ItemIds, *, schema: str | None = None, claims: bool = True) -> AckResult:
    """`AsyncTracker.ack` on the default tracker of `schema`."""
    return await default(schema).ack(session, item_ids, claims=claims)


async def apply_masks(
    session: AsyncSession,
    masks: Mapping[tuple[int, int], GroupMask],
    *,
    schema: str | None = None,
    reject_invalid: bool = False,
    skip_locked: bool = False,
) -> AckResult:
    """`AsyncTracker.apply_masks` on the default tracker of `schema`."""
    return await default(schema).apply_masks(session, masks, reject_invalid=reject_invalid, skip_locked=skip_locked)


async def fail(session: AsyncSession, item_ids: ItemIds, reason: str, *, schema: str | None = None) -> FailResult:
    """`AsyncTracker.fail` on the default tracker of `schema`."""
    return await default(schema).fail(session, item_ids, reason)


async def fail_masks(
    session: AsyncSession,
    masks: Mapping[tuple[int, int], GroupMask],
    reason: str,
    *,
    schema: str | None = None,
    reject_invalid: bool = False,
    skip_locked: bool = False,
) -> AckResult:
    """`AsyncTracker.fail_masks` on the default tracker of `schema`."""
    return await default(schema).fail_masks(
        session, masks, reason, reject_invalid=reject_invalid, skip_locked=skip_locked
    )


async def failures(
    session: AsyncSession,
    batch: Batch | int,
    *,
    after: str | None = None,
    limit: int = 100,
    schema: str | None = None,
) -> FailurePage:
    """`AsyncTracker.failures` on the default tracker of `schema`."""
    return await default(schema).failures(session, batch, after=after, limit=limit)


async def apply_outcomes(
    session: AsyncSession,
    steps: Sequence[tuple[str | None, Mapping[tuple[int, int], GroupMask]]],
    *,
    reject_invalid: bool = False,
    skip_locked: bool = False,
    schema: str | None = None,
) -> list[AckResult]:
    """`AsyncTracker.apply_outcomes` on the default tracker of `schema`."""
    return await default(schema).apply_outcomes(session, steps, reject_invalid=reject_invalid, skip_locked=skip_locked)


async def exactly_once(
    session: AsyncSession, item_id: str | bytes, effect: AsyncEffect[T], *, schema: str | None = None
) -> Processed[T]:
    """`AsyncTracker.exactly_once` on the default tracker of `schema`."""
    return await default(schema).exactly_once(session, item_id, effect)


# </async face>

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
    "fail",
    "fail_masks",
    "apply_outcomes",
    "failures",
    "exactly_once",
]
