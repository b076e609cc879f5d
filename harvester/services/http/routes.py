"""The routes of API v1: open a batch, its status, add items, close it, wait for its completion
(long-poll or event stream), ack ids. create_app (app.py) adds them with what they share: the store,
`respond` (a write, once per Idempotency-Key, audited), `call` (tracker errors as problem documents),
the completion watcher and the waits held per token. The routes of failures are in outcomes.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

import psycopg
from fastapi import FastAPI, Path, Query, Request
from starlette.responses import Response

from harvester.config import Config, ack_topics
from harvester.services.http import models, problems
from harvester.services.http.backend import Store, StoreUnavailable
from harvester.services.http.completion import CompletionWatcher
from harvester.services.http.idempotency import Reply
from harvester.services.http.outcomes import check_thresholds, parent_problem
from harvester.services.http.params import ACK_PROBLEMS, BatchId, IdempotencyKey, responses, too_many_ids
from harvester.services.http.problems import Problem
from harvester.services.http.tenants import DEFAULT, own, own_acked
from harvester.services.http.waits import HeldStream, WaitsPerToken
from tracker import BatchStatus
from tracker.errors import MalformedItemId, TrackerError, UnknownBatch


def _column(tenant: object) -> str | None:
    """The batch's tenant column: null for the default tenant (as batches opened by the Python API or SQL)."""
    name = getattr(tenant, "name", DEFAULT)
    return None if name == DEFAULT else str(name)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (its request, a GET, has no body left to read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _status(batch_id: int, s: BatchStatus) -> models.Status:
    return models.Status(
        batch_id=batch_id,
        state=s.state,
        complete=s.state == "complete",
        total=s.total,
        pending=s.pending,
        user_key=s.user_key,
        created_at=s.created_at,
        closed_at=s.closed_at,
        completed_at=s.completed_at,
        last_activity_at=s.last_activity_at,
        expired_at=s.expired_at,
        outcome=s.outcome,
        succeeded=s.succeeded,
        failed=s.failed,
        late=s.late,
        parent_id=s.parent_id,
        children_open=s.children_open,
        children=s.children,
        children_failed=s.children_failed,
    )


def add_v1_routes(
    app: FastAPI,
    *,
    cfg: Config,
    store: Store,
    respond: Callable[[Request, Callable[[Store], Awaitable[Reply]]], Awaitable[Response]],
    call: Callable[..., Awaitable[Any]],
    watcher: CompletionWatcher,
    waits: WaitsPerToken,
    dependencies: list,
) -> None:
    """POST /v1/batches, GET /v1/batches/{batch_id}, its items, close, completion and events, and
    POST /v1/acks and /v1/acks/{item_id}."""
    h = cfg.http
    # every ack topic of the configuration (one per outbox schema), not only the `database` one's
    reserved_topics = {*ack_topics(cfg).values(), cfg.acker.dead_letter_topic, cfg.harvester.leader_topic}

    @app.post(
        "/v1/batches",
        status_code=201,
        response_model=models.Batch,
        responses=responses(
            "forbidden", "parent-not-open", "nesting-too-deep", "unknown-batch-in-body", "idempotency-key-reused"
        ),
        tags=["batches"],
        summary="Open a batch",
        dependencies=dependencies,
    )
    async def create_batch(
        request: Request, idempotency_key: IdempotencyKey = None, body: models.CreateBatch | None = None
    ) -> Response:
        body = body or models.CreateBatch()
        if body.user_key is not None and "\x00" in body.user_key:
            raise Problem("invalid-request", "user_key contains a NUL character", field="body.user_key")

        tenant = request.state.tenant
        topic = body.completion_topic or cfg.harvester.default_completion_topic
        if topic in reserved_topics:  # completions there would be read as acks, leadership or dead letters
            raise Problem(
                "forbidden",
                f"topic {topic!r} is one the reaper itself reads (acks, leadership, dead letters)",
                field="body.completion_topic",
            )
        if not tenant.may_complete_into(topic):
            raise Problem(
                "forbidden",
                f"tenant {tenant.name} may not complete batches into topic {topic!r} (http.tenants_file)",
                field="body.completion_topic",
            )

        check_thresholds(body)

        async def work(s: Store) -> Reply:
            if body.parent is not None:  # another tenant's parent answers as one that does not exist
                owner = (await s.owners([body.parent])).get(body.parent)
                if owner is not None and owner[0] != tenant.name:
                    raise parent_problem(UnknownBatch(body.parent, role="parent"))
            try:
                b = await s.open_batch(
                    body.user_key,
                    body.completion_topic,
                    _column(tenant),
                    parent=body.parent,
                    tolerated_failures=body.tolerated_failures,
                    tolerated_failure_ratio=body.tolerated_failure_ratio,
                )
            except TrackerError as exc:
                raise parent_problem(exc) from None
            doc = models.Batch(
                batch_id=b.id,
                user_key=b.user_key,
                completion_topic=b.completion_topic,
                state="open",
                created_at=b.created_at,
                parent_id=body.parent,
            )
            return Reply(201, doc.model_dump(mode="json"), {"Location": f"/v1/batches/{b.id}"})

        return await respond(request, work)

    @app.get(
        "/v1/batches/{batch_id}",
        response_model=models.Status,
        responses=responses("unknown-batch"),  # an expired batch answers 200, state "expired"
        tags=["batches"],
        summary="A batch's status",
        dependencies=dependencies,
    )
    async def get_status(request: Request, batch_id: BatchId) -> models.Status:
        await own(store, request.state.tenant, [batch_id])
        return _status(batch_id, await call(store.status(batch_id), batch_in_path=True))

    @app.post(
        "/v1/batches/{batch_id}/items",
        response_model=models.Added,
        responses=responses("unknown-batch", "batch-not-open", "batch-expired", "idempotency-key-reused"),
        tags=["batches"],
        summary="Track more items; returns the groups that hold them",
        dependencies=dependencies,
    )
    async def add_items(
        request: Request, batch_id: BatchId, body: models.AddItems, idempotency_key: IdempotencyKey = None
    ) -> Response:
        if body.count > h.max_items_per_add:
            raise Problem(
                "invalid-request",
                f"count {body.count} is over this server's limit of {h.max_items_per_add} items per request",
                field="body.count",
                limit=h.max_items_per_add,
            )

        async def work(s: Store) -> Reply:
            await own(s, request.state.tenant, [batch_id])
            handles = await call(s.add_items(batch_id, body.count), batch_in_path=True)
            groups = [models.Group(group_id=g.group_id, start=g.start, upto=g.upto) for g in handles]
            return Reply(200, models.Added(batch_id=batch_id, count=body.count, groups=groups).model_dump(mode="json"))

        return await respond(request, work)

    @app.post(
        "/v1/batches/{batch_id}/close",
        response_model=models.Closed,
        responses=responses("unknown-batch", "batch-expired", "idempotency-key-reused"),
        tags=["batches"],
        summary="Close a batch (no more items)",
        dependencies=dependencies,
    )
    async def close(request: Request, batch_id: BatchId, idempotency_key: IdempotencyKey = None) -> Response:
        async def work(s: Store) -> Reply:
            await own(s, request.state.tenant, [batch_id])
            complete = await call(s.close_batch(batch_id), batch_in_path=True)
            doc = models.Closed(batch_id=batch_id, complete=complete).model_dump(mode="json")
            return Reply(200, doc, completed=[batch_id] if complete else [])

        return await respond(request, work)

    @app.get(
        "/v1/batches/{batch_id}/completion",
        response_model=models.Status,
        responses=responses("unknown-batch"),
        tags=["batches"],
        summary="Long-poll: answers once the batch is complete or expired, or after `wait` s",
        dependencies=dependencies,
    )
    async def completion(
        request: Request,
        batch_id: BatchId,
        wait: Annotated[float, Query(ge=0, description="seconds to wait at most")] = 30.0,
    ) -> models.Status | Response:
        if not wait <= h.long_poll_max:  # also NaN
            written = request.query_params.get("wait", "")
            shown = written if len(written) <= 40 else written[:40] + "..."
            raise Problem(
                "invalid-request",
                f"wait {shown} is over this server's limit of {h.long_poll_max} s",
                field="query.wait",
                limit=h.long_poll_max,
            )
        deadline = time.monotonic() + wait
        await own(store, request.state.tenant, [batch_id])
        release = waits.hold(request.state.token)
        gone = asyncio.ensure_future(_disconnected(request))  # a client that leaves frees its place at once
        try:
            s = await call(store.status(batch_id), batch_in_path=True)
            while s.state in ("open", "closed") and not app.state.draining:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                waiting = asyncio.ensure_future(watcher.wait(batch_id, left))
                await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
                if gone.done():
                    waiting.cancel()
                    return Response(status_code=204)  # nobody is there to read it
                s = await call(store.status(batch_id), batch_in_path=True)
        finally:
            gone.cancel()
            release()
        return _status(batch_id, s)

    @app.get(
        "/v1/batches/{batch_id}/events",
        tags=["batches"],
        summary="Server-sent events: the status now, and "
        "again when the batch completes or expires (then the stream ends); a comment every 15 s keeps it open",
        responses={
            200: {
                "content": {"text/event-stream": {}},
                "description": "event: status | complete | expired; data: the Status document",
            },
            **responses("unknown-batch"),
        },
        dependencies=dependencies,
    )
    async def events(request: Request, batch_id: BatchId) -> Response:
        await own(store, request.state.tenant, [batch_id])
        first = await call(store.status(batch_id), batch_in_path=True)  # 404 before the stream starts
        release = waits.hold(request.state.token)

        async def stream() -> AsyncIterator[bytes]:
            s, last = first, None
            while True:
                if s.state != last:
                    kind = s.state if s.state in ("complete", "expired") else "status"
                    body = _status(batch_id, s).model_dump_json()
                    yield f"event: {kind}\ndata: {body}\n\n".encode()
                    last = s.state
                if s.state in ("complete", "expired") or app.state.draining:
                    return
                await watcher.wait(batch_id, 15.0)
                if app.state.draining:
                    return
                try:
                    s = await store.status(batch_id)
                except (TrackerError, StoreUnavailable, psycopg.Error):
                    return  # the batch was removed (retention) or the database went away: end the stream
                if s.state == last:
                    yield b": keep-alive\n\n"

        return HeldStream(
            stream(),
            release,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _ack(request: Request, ids: list[str]) -> Response:
        if len(ids) > h.max_ids_per_request:
            raise too_many_ids(len(ids), h.max_ids_per_request)

        async def work(s: Store) -> Reply:
            await own_acked(s, request.state.tenant, ids, request.app.state.cpu)
            r = await call(s.ack(ids), batch_in_path=False)
            doc = models.AckResult(acked=r.acked, duplicates=r.duplicates, completed=r.completed).model_dump(
                mode="json"
            )
            return Reply(200, doc, completed=list(r.completed))

        return await respond(request, work)

    @app.post(
        "/v1/acks",
        response_model=models.AckResult,
        responses=responses(*ACK_PROBLEMS),
        tags=["acks"],
        summary="Ack item ids and runs (bulk)",
        dependencies=dependencies,
    )
    async def ack_bulk(request: Request, body: models.AckIds, idempotency_key: IdempotencyKey = None) -> Response:
        return await _ack(request, body.ids)

    @app.post(
        "/v1/acks/{item_id}",
        response_model=models.AckResult,
        responses=responses(*ACK_PROBLEMS),
        tags=["acks"],
        summary="Ack one item id or run",
        dependencies=dependencies,
    )
    async def ack_one(
        request: Request,
        item_id: Annotated[str, Path(max_length=64)],
        idempotency_key: IdempotencyKey = None,
    ) -> Response:
        if "\x00" in item_id:  # a NUL cannot reach PostgreSQL text: refused here, named like any malformed id
            raise problems.from_tracker(MalformedItemId(item_id, "holds a NUL character"), batch_in_path=False)
        return await _ack(request, [item_id])
