"""Outcomes over HTTP: record items as failed (with a reason), read a batch's failures a page at a
time, and the checks of a batch opened under a parent or with failure thresholds.

A failure is posted as an ack is (the same bearer token, tenant rule, Idempotency-Key, body and id
limits): the first outcome recorded for an item wins, later ones are duplicates.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request
from starlette.responses import Response

from harvester.config import HttpConfig
from harvester.services.http import models, problems
from harvester.services.http.backend import Store
from harvester.services.http.idempotency import Reply
from harvester.services.http.params import ACK_PROBLEMS, ID_MAX, BatchId, IdempotencyKey, responses, too_many_ids
from harvester.services.http.problems import Problem
from harvester.services.http.tenants import own, own_acked
from tracker.errors import DepthExceeded, IndexOutOfRange, MalformedItemId, ParentNotOpen, TrackerError, UnknownBatch
from tracker.ids import parse_item_id

REASON_MAX = 500  # characters (the tracker's and the SQL functions' limit)
FAILURES_LIMIT_MAX = 1000  # failures per page (tracker.failures)


def _shown(value: object) -> str:
    text = repr(value)
    return text[:80] + "..." if len(text) > 80 else text


def check_thresholds(body: models.CreateBatch) -> None:
    """A batch's parent and thresholds, refused before anything is written, naming the value."""
    if body.parent is not None and not 0 <= body.parent <= ID_MAX:
        raise Problem(
            "invalid-request",
            f"parent {body.parent}: a batch id is 0 to {ID_MAX}",
            field="body.parent",
            value=body.parent,
        )
    n = body.tolerated_failures
    if n is not None and not 0 <= n <= ID_MAX:
        raise Problem(
            "invalid-request",
            f"tolerated_failures {n}: must be between 0 and {ID_MAX}",
            field="body.tolerated_failures",
            value=n,
        )
    r = body.tolerated_failure_ratio
    if r is not None and not 0 <= r <= 1:
        raise Problem(
            "invalid-request",
            f"tolerated_failure_ratio {r}: must be between 0 and 1",
            field="body.tolerated_failure_ratio",
            value=r,
        )


def parent_problem(exc: TrackerError) -> Problem:
    """The problem of a batch that could not be opened under its parent (or another tracker error)."""
    if isinstance(exc, UnknownBatch):  # the only batch an open names is the parent
        return Problem("unknown-batch-in-body", str(exc), batch_id=exc.batch_id, field="body.parent")
    if isinstance(exc, ParentNotOpen):
        return Problem("parent-not-open", str(exc), batch_id=exc.batch_id, state=exc.state, field="body.parent")
    if isinstance(exc, DepthExceeded):
        return Problem("nesting-too-deep", str(exc), batch_id=exc.batch_id, field="body.parent")
    return problems.from_tracker(exc, batch_in_path=False)


def _check_reason(reason: str) -> None:
    why = None
    if not reason:
        why = "must be a non-empty string"
    elif len(reason) > REASON_MAX:
        why = f"is longer than {REASON_MAX} characters ({len(reason)})"
    elif "\x00" in reason:
        why = "contains a NUL character, which Postgres text cannot hold"
    elif any("\ud800" <= ch <= "\udfff" for ch in reason):
        why = "is not valid UTF-8 text (a lone surrogate)"
    if why is not None:
        raise Problem("invalid-request", f"reason {_shown(reason)}: {why}", field="body.reason")


def _check_after(batch_id: int, after: str | None) -> None:
    if after is None:
        return
    try:
        item = parse_item_id(after)
    except (MalformedItemId, IndexOutOfRange):  # IndexOutOfRange: an index no group can hold
        item = None
    if item is None or item.batch_id != batch_id:
        raise Problem(
            "invalid-request",
            f"after {_shown(after)} is not an item id of batch {batch_id} (a page's `next`)",
            field="query.after",
        )


def add_outcome_routes(
    app: FastAPI,
    *,
    store: Store,
    h: HttpConfig,
    respond: Callable[[Request, Callable[[Store], Awaitable[Reply]]], Awaitable[Response]],
    call: Callable[..., Awaitable[Any]],
    dependencies: list,
) -> None:
    """POST /v1/failures and GET /v1/batches/{batch_id}/failures."""

    @app.post(
        "/v1/failures",
        response_model=models.FailResult,
        responses=responses(*ACK_PROBLEMS),
        tags=["acks"],
        summary="Record item ids and runs as failed, with a reason (bulk)",
        dependencies=dependencies,
    )
    async def fail(request: Request, body: models.FailIds, idempotency_key: IdempotencyKey = None) -> Response:
        ids = body.ids
        _check_reason(body.reason)
        if len(ids) > h.max_ids_per_request:
            raise too_many_ids(len(ids), h.max_ids_per_request)

        async def work(s: Store) -> Reply:
            await own_acked(s, request.state.tenant, ids, request.app.state.cpu)
            r = await call(s.fail(ids, body.reason), batch_in_path=False)
            doc = models.FailResult(failed=r.failed, duplicates=r.duplicates, completed=r.completed)
            return Reply(200, doc.model_dump(mode="json"), completed=list(r.completed))

        return await respond(request, work)

    @app.get(
        "/v1/batches/{batch_id}/failures",
        response_model=models.Failures,
        responses=responses("unknown-batch"),
        tags=["batches"],
        summary="A page of the batch's failed items with their reasons, in item order",
        dependencies=dependencies,
    )
    async def failures(
        request: Request,
        batch_id: BatchId,
        after: Annotated[str | None, Query(max_length=64, description="a previous page's `next`")] = None,
        limit: Annotated[int, Query(description=f"1 to {FAILURES_LIMIT_MAX} failures")] = 100,
    ) -> models.Failures:
        if not 1 <= limit <= FAILURES_LIMIT_MAX:
            raise Problem(
                "invalid-request",
                f"limit {limit}: must be between 1 and {FAILURES_LIMIT_MAX}",
                field="query.limit",
                limit=FAILURES_LIMIT_MAX,
            )
        _check_after(batch_id, after)
        await own(store, request.state.tenant, [batch_id])
        items, nxt = await call(store.failures(batch_id, after, limit), batch_in_path=True)
        return models.Failures(
            batch_id=batch_id, failures=[models.Failure(item_id=i, reason=r) for i, r in items], next=nxt
        )
