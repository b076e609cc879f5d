"""The sync face: `Tracker`, on a psycopg `Connection` or a SQLAlchemy `Session`/`Connection`.

    t = Tracker(schema="reaper", outbox_table="outbox", completion_topic="batch-completions")
    batch = t.open_batch(session, user_key="catalog-42")
    t.enqueue(session, batch, items, topic="process-item")
    t.close_batch(session, batch)

Every call runs inside the caller's transaction and never commits or rolls it back (see
tracker/drivers/sync_psycopg.py for each connection mode). The asyncio face is `tracker.aio.AsyncTracker`.

The region marked below is generated from the asyncio face (tracker/aio.py) by
deploy/async_to_sync.py: edit it there. What differs between the faces is written by hand above.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from tracker.config import DEFAULT_SCHEMA
from tracker.core.acks import AckResult, FailResult, FailurePage, Processed
from tracker.core.batches import Batch, BatchStatus, GroupHandle
from tracker.core.enqueue import Headers, KeyArg
from tracker.core.operations import ItemIds, TrackerCore
from tracker.core.steps import Op
from tracker.core.validate import check_reason, id_list
from tracker.drivers import sync_psycopg as driver
from tracker.drivers.connections import SyncSession, sync_connection
from tracker.ids import GroupMask, fold

T = TypeVar("T")
SyncEffect = Callable[[SyncSession], T]


def _run(session: SyncSession, op: Op[T], effect: Callable[[], object] | None = None, within: str | None = None) -> T:
    return driver.run(sync_connection(session), op, effect=effect, within=within)


_fold = fold


def _effect_call(effect: SyncEffect[T], session: SyncSession) -> Callable[[], object]:
    """`effect(session)`."""
    return functools.partial(effect, session)


# <sync face: generated from tracker/aio.py by deploy/async_to_sync.py; do not edit>
class Tracker(TrackerCore):
    """Fan-out tracking for one schema and outbox table. Holds no connection: one tracker serves
    every session (and thread)."""

    def open_batch(
        self,
        session: SyncSession,
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
        batch = _run(session, op)
        self._count_open()
        return batch

    def add_items(self, session: SyncSession, batch: Batch | int, n: int) -> list[GroupHandle]:
        """Track `n` items without writing messages (for producers that publish elsewhere).
        Returns the groups holding them, in item order."""
        op = self._add_op(batch, n)
        return _run(session, op)

    def enqueue(
        self,
        session: SyncSession,
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
        return _run(session, op)

    def close_batch(self, session: SyncSession, batch: Batch | int) -> bool:
        """Close the batch: no more items. Returns whether it is complete (now or already).
        Closing a closed or complete batch changes nothing; an expired one raises BatchExpired."""
        op = self._close_op(batch)
        complete, closed_now = _run(session, op)
        self._count_close(complete, closed_now)
        return complete

    def status(self, session: SyncSession, batch: Batch | int) -> BatchStatus:
        """The batch's state and counts, as this transaction sees them."""
        return _run(session, self._status_op(batch))

    def ack(self, session: SyncSession, item_ids: ItemIds, *, claims: bool = True) -> AckResult:
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
        op = self._ack_op(entries, _fold(entries), claims)
        result = _run(session, op)
        self._count_ack(result, started)
        return result

    def apply_masks(
        self,
        session: SyncSession,
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
        result = _run(session, op)
        self._count_ack(result, started)
        return result

    def fail(self, session: SyncSession, item_ids: ItemIds, reason: str) -> FailResult:
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
        result = _run(session, self._fail_op(entries, _fold(entries), checked))
        self._count_completed(len(result.completed))
        return result

    def fail_masks(
        self,
        session: SyncSession,
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
        result = _run(session, self._apply_op(masks, reject_invalid, skip_locked, checked))
        self._count_completed(len(result.completed))
        return result

    def apply_outcomes(
        self,
        session: SyncSession,
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
        results = _run(session, self._apply_steps_op(steps, reject_invalid, skip_locked))
        self._count_acks(steps, results, started)
        return results

    def failures(
        self, session: SyncSession, batch: Batch | int, *, after: str | None = None, limit: int = 100
    ) -> FailurePage:
        """A page of the batch's failed items with their reasons, in item order: at most `limit`
        (1 to 1000) after the item id `after` (a previous page's `next`; None: from the start)."""
        return _run(session, self._failures_op(batch, after, limit))

    def exactly_once(self, session: SyncSession, item_id: str | bytes, effect: SyncEffect[T]) -> Processed[T]:
        """Ack `item_id` and, only if its bit was still set, run `effect(session)`, all in one
        savepoint of the caller's transaction: the effect and the ack commit or roll back together.
        A redelivery of a processed item returns first_time=False and does not run the effect.
        On the asyncio face `effect` may be a coroutine function."""
        started = time.perf_counter()
        op = self._exactly_once_op(item_id)
        result = _run(session, op, effect=_effect_call(effect, session))
        self._count_ack(result.ack, started)
        return result  # type: ignore[return-value]


@functools.lru_cache(maxsize=32)
def default(schema: str | None = None) -> Tracker:
    """The default Tracker of a schema (outbox table "outbox", topic "batch-completions"): what
    the module-level functions use. For anything else build your own Tracker and call its methods."""
    return Tracker(schema=schema or DEFAULT_SCHEMA)


def open_batch(
    session: SyncSession,
    *,
    user_key: str | None = None,
    completion_topic: str | None = None,
    parent: Batch | int | None = None,
    tolerated_failures: int | None = None,
    tolerated_failure_ratio: float | None = None,
    schema: str | None = None,
) -> Batch:
    """`Tracker.open_batch` on the default tracker of `schema`."""
    return default(schema).open_batch(
        session,
        user_key=user_key,
        completion_topic=completion_topic,
        parent=parent,
        tolerated_failures=tolerated_failures,
        tolerated_failure_ratio=tolerated_failure_ratio,
    )


def add_items(session: SyncSession, batch: Batch | int, n: int, *, schema: str | None = None) -> list[GroupHandle]:
    """`Tracker.add_items` on the default tracker of `schema`."""
    return default(schema).add_items(session, batch, n)


def enqueue(
    session: SyncSession,
    batch: Batch | int,
    items: object,
    *,
    topic: str,
    key: KeyArg = None,
    headers: Headers = None,
    schema: str | None = None,
) -> list[GroupHandle]:
    """`Tracker.enqueue` on the default tracker of `schema`."""
    return default(schema).enqueue(session, batch, items, topic=topic, key=key, headers=headers)


def close_batch(session: SyncSession, batch: Batch | int, *, schema: str | None = None) -> bool:
    """`Tracker.close_batch` on the default tracker of `schema`."""
    return default(schema).close_batch(session, batch)


def status(session: SyncSession, batch: Batch | int, *, schema: str | None = None) -> BatchStatus:
    """`Tracker.status` on the default tracker of `schema`."""
    return default(schema).status(session, batch)


def ack(session: SyncSession, item_ids: ItemIds, *, schema: str | None = None, claims: bool = True) -> AckResult:
    """`Tracker.ack` on the default tracker of `schema`."""
    return default(schema).ack(session, item_ids, claims=claims)


def apply_masks(
    session: SyncSession,
    masks: Mapping[tuple[int, int], GroupMask],
    *,
    schema: str | None = None,
    reject_invalid: bool = False,
    skip_locked: bool = False,
) -> AckResult:
    """`Tracker.apply_masks` on the default tracker of `schema`."""
    return default(schema).apply_masks(session, masks, reject_invalid=reject_invalid, skip_locked=skip_locked)


def fail(session: SyncSession, item_ids: ItemIds, reason: str, *, schema: str | None = None) -> FailResult:
    """`Tracker.fail` on the default tracker of `schema`."""
    return default(schema).fail(session, item_ids, reason)


def fail_masks(
    session: SyncSession,
    masks: Mapping[tuple[int, int], GroupMask],
    reason: str,
    *,
    schema: str | None = None,
    reject_invalid: bool = False,
    skip_locked: bool = False,
) -> AckResult:
    """`Tracker.fail_masks` on the default tracker of `schema`."""
    return default(schema).fail_masks(session, masks, reason, reject_invalid=reject_invalid, skip_locked=skip_locked)


def failures(
    session: SyncSession,
    batch: Batch | int,
    *,
    after: str | None = None,
    limit: int = 100,
    schema: str | None = None,
) -> FailurePage:
    """`Tracker.failures` on the default tracker of `schema`."""
    return default(schema).failures(session, batch, after=after, limit=limit)


def apply_outcomes(
    session: SyncSession,
    steps: Sequence[tuple[str | None, Mapping[tuple[int, int], GroupMask]]],
    *,
    reject_invalid: bool = False,
    skip_locked: bool = False,
    schema: str | None = None,
) -> list[AckResult]:
    """`Tracker.apply_outcomes` on the default tracker of `schema`."""
    return default(schema).apply_outcomes(session, steps, reject_invalid=reject_invalid, skip_locked=skip_locked)


def exactly_once(
    session: SyncSession, item_id: str | bytes, effect: SyncEffect[T], *, schema: str | None = None
) -> Processed[T]:
    """`Tracker.exactly_once` on the default tracker of `schema`."""
    return default(schema).exactly_once(session, item_id, effect)


# </sync face>
