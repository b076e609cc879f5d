"""What the sync and asyncio faces share: a tracker's configuration, its statements and metrics,
and the operations built from them (generators of steps, no I/O; see steps.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Union

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from tracker import metrics
from tracker.config import DEFAULT_COMPLETION_TOPIC, DEFAULT_OUTBOX_TABLE, DEFAULT_SCHEMA, TrackerConfig
from tracker.core import acks, batches, enqueue
from tracker.core.acks import AckResult, Processed, exactly_once_op
from tracker.core.batches import Batch, BatchStatus, GroupHandle
from tracker.core.steps import Op
from tracker.core.validate import check_reason
from tracker.errors import (
    BatchExpired,
    IndexOutOfRange,
    InvalidArgument,
    InvalidValue,
    TrackerError,
    UnknownBatch,
    UnknownGroup,
)
from tracker.ids import GROUP_BITS_MAX, GroupMask, parse_ack, parse_item_id

ItemIds = Union[str, bytes, Iterable[str | bytes]]


class TrackerCore:
    """Configuration and operations; `Tracker` and `AsyncTracker` add the faces."""

    def __init__(
        self,
        *,
        schema: str = DEFAULT_SCHEMA,
        outbox_table: str = DEFAULT_OUTBOX_TABLE,
        completion_topic: str = DEFAULT_COMPLETION_TOPIC,
        registry: CollectorRegistry | None = REGISTRY,
        metrics_prefix: str = metrics.DEFAULT_PREFIX,
    ) -> None:
        self.config = TrackerConfig(schema, outbox_table, completion_topic)
        self._q_batches = batches.statements(schema, outbox_table)
        self._q_acks = acks.statements(schema, outbox_table)
        self._copy_sql, self._insert_sql = enqueue.statements(schema, outbox_table)
        self._m: tuple[Counter, Counter, Counter, Counter, Counter, Histogram] | None = None
        if registry is not None:
            m = metrics.for_registry(registry, metrics_prefix)
            self._m = (
                m.batches_opened.labels(schema),
                m.batches_closed.labels(schema),
                m.batches_completed.labels(schema),
                m.acks_applied.labels(schema),
                m.acks_duplicate.labels(schema),
                m.ack_apply_duration.labels(schema),
            )

    @property
    def schema(self) -> str:
        return self.config.schema

    @property
    def outbox_table(self) -> str:
        return self.config.outbox_table

    @property
    def completion_topic(self) -> str:
        return self.config.completion_topic

    def __repr__(self) -> str:
        c = self.config
        return (
            f"{type(self).__name__}(schema={c.schema!r}, outbox_table={c.outbox_table!r}, "
            f"completion_topic={c.completion_topic!r})"
        )

    # ------------------------------------------------------------ operations

    def _open_op(
        self,
        user_key: object,
        completion_topic: object,
        parent: object = None,
        tolerated_failures: object = None,
        tolerated_failure_ratio: object = None,
    ) -> Op[Batch]:
        return batches.open_op(
            self._q_batches, user_key, completion_topic, parent, tolerated_failures, tolerated_failure_ratio
        )

    def _add_op(self, batch: object, n: object) -> Op[list[GroupHandle]]:
        return batches.add_op(self._q_batches, batch, n)  # type: ignore[arg-type]

    def _enqueue_op(
        self, batch: object, items: object, topic: object, key: object, headers: object
    ) -> Op[list[GroupHandle]]:
        return enqueue.enqueue_op(
            self._q_batches,
            self._copy_sql,
            self._insert_sql,
            batch,
            items,
            topic,
            key,
            headers,
            (self.config.schema, self.config.outbox_table),
        )

    def _close_op(self, batch: object) -> Op[tuple[bool, bool]]:
        return batches.close_op(self._q_batches, batch, self.config.completion_topic)  # type: ignore[arg-type]

    def _status_op(self, batch: object) -> Op[BatchStatus]:
        return batches.status_op(self._q_batches, batch)  # type: ignore[arg-type]

    def _apply_op(
        self, masks: object, reject_invalid: bool, skip_locked: bool = False, reason: str | None = None
    ) -> Op[AckResult]:
        if not isinstance(masks, Mapping) or not all(isinstance(m, GroupMask) for m in masks.values()):
            raise InvalidArgument("masks", masks, "a mapping of (batch, group) to GroupMask, from tracker.fold")
        return acks.apply_op(
            self._q_acks, masks, self.config.completion_topic, reject_invalid, skip_locked=skip_locked, reason=reason
        )

    def _apply_steps_op(self, steps: object, reject_invalid: bool, skip_locked: bool) -> Op[list[AckResult]]:
        if not isinstance(steps, (list, tuple)):
            raise InvalidArgument("steps", steps, "a list of (reason or None, masks from tracker.fold)")
        checked: list[tuple[str | None, Mapping[tuple[int, int], GroupMask]]] = []
        for step in steps:
            if not isinstance(step, tuple) or len(step) != 2:
                raise InvalidArgument("steps", step, "a (reason or None, masks from tracker.fold) pair")
            reason, masks = step
            if not isinstance(masks, Mapping) or not all(isinstance(m, GroupMask) for m in masks.values()):
                raise InvalidArgument("masks", masks, "a mapping of (batch, group) to GroupMask, from tracker.fold")
            checked.append((None if reason is None else check_reason(reason), masks))
        return acks.apply_steps_op(
            self._q_acks, checked, self.config.completion_topic, reject_invalid, skip_locked=skip_locked
        )

    def _ack_op(
        self, entries: list[str | bytes], masks: dict[tuple[int, int], GroupMask], claims: bool
    ) -> Op[AckResult]:
        """The ack of `entries`, already folded into `masks` (the asyncio face folds off the loop)."""
        try:
            if not claims or sum(m.count for m in masks.values()) > acks.CLAIMS_PER_CALL_MAX:
                # a bulk ack: masked updates under the batch locks (one row per item would cost
                # far more; bulk ackers run short transactions of their own)
                return (yield from acks.apply_op(self._q_acks, masks, self.config.completion_topic, False))
            # claims: no batch lock held for the caller's transaction (its consumers run in parallel)
            return (yield from acks.claim_op(self._q_acks, masks, self.config.completion_topic))
        except (IndexOutOfRange, UnknownGroup, UnknownBatch, BatchExpired) as exc:
            raise as_written(exc, entries) from None

    def _fail_op(
        self, entries: list[str | bytes], masks: dict[tuple[int, int], GroupMask], reason: str
    ) -> Op[acks.FailResult]:
        try:
            return (yield from acks.fail_op(self._q_acks, masks, self.config.completion_topic, reason))
        except (IndexOutOfRange, UnknownGroup, UnknownBatch, BatchExpired) as exc:
            raise as_written(exc, entries) from None

    def _failures_op(self, batch: object, after: object, limit: object) -> Op[acks.FailurePage]:
        batch_id = batches.batch_id_of(batch)  # type: ignore[arg-type]
        if not isinstance(limit, int) or isinstance(limit, bool):
            raise InvalidArgument("limit", limit, f"an int from 1 to {acks.FAILURES_LIMIT_MAX}")
        if not 1 <= limit <= acks.FAILURES_LIMIT_MAX:
            raise InvalidValue("limit", limit, f"must be between 1 and {acks.FAILURES_LIMIT_MAX}")
        cursor = None
        if after is not None:
            if not isinstance(after, str):
                raise InvalidArgument("after", after, "an item id str (a page's `next`) or None")
            item = parse_item_id(after)
            if item.batch_id != batch_id or item.index >= GROUP_BITS_MAX:
                raise InvalidValue("after", after, f"is not an item id of batch {batch_id}")
            cursor = str(item)
        return (yield from acks.failures_op(self._q_acks, batch_id, cursor, limit))

    def _exactly_once_op(self, item_id: object) -> Op[Processed[object]]:
        return exactly_once_op(self._q_acks, item_id, self.config.completion_topic)

    # ------------------------------------------------------------ metrics of returned calls

    def _count_open(self) -> None:
        if self._m:
            self._m[0].inc()

    def _count_close(self, complete: bool, closed_now: bool) -> None:
        if self._m and closed_now:
            self._m[1].inc()
            if complete:
                self._m[2].inc()

    def _count_acks(self, steps: object, results: list[AckResult], started: float) -> None:
        """The metrics of the ack steps of an apply_outcomes call, as one ack call, and the batches
        any of its steps completed (a failure finishes a batch too)."""
        acked = [r for (reason, _m), r in zip(steps, results) if reason is None]  # type: ignore[call-overload]
        if acked:
            self._count_ack(
                AckResult(acked=sum(r.acked for r in acked), duplicates=sum(r.duplicates for r in acked)), started
            )
        self._count_completed(sum(len(r.completed) for r in results))

    def _count_completed(self, batches: int) -> None:
        if self._m and batches:
            self._m[2].inc(batches)

    def _count_ack(self, result: AckResult, started: float) -> None:
        if self._m:
            self._m[3].inc(result.acked)
            self._m[4].inc(result.duplicates)
            self._m[2].inc(len(result.completed))
            self._m[5].observe(time.perf_counter() - started)


def as_written(exc: TrackerError, entries: list[str | bytes]) -> TrackerError:
    """The same error, naming the caller's entry (a run as the caller wrote it, not its first bad
    index). Only on the error path: one pass over the call's entries."""
    for entry in entries:
        try:
            run = parse_ack(entry)
        except TrackerError:
            continue
        if isinstance(exc, IndexOutOfRange) and isinstance(exc.culprit, tuple):
            batch_id, group_id = exc.culprit
            if (run.batch_id, run.group_id) == (batch_id, group_id) and run.end >= exc.size:
                return IndexOutOfRange(_shown(entry), exc.size)
        elif isinstance(exc, UnknownGroup):
            if (run.batch_id, run.group_id) == (exc.batch_id, exc.group_id):
                return UnknownGroup(exc.batch_id, exc.group_id, _shown(entry))
        elif isinstance(exc, UnknownBatch):
            if run.batch_id == exc.batch_id:
                return UnknownBatch(exc.batch_id, _shown(entry))
        elif isinstance(exc, BatchExpired):
            if run.batch_id == exc.batch_id:
                return BatchExpired(exc.batch_id, _shown(entry))
    return exc


def _shown(entry: str | bytes) -> str:
    return entry if isinstance(entry, str) else entry.decode("ascii", "backslashreplace")
