"""The tracker over HTTP (v1): batches, items, close, acks, status, completion long-poll.

`create_app(cfg, store)` builds the ASGI application: FastAPI routes inside three small ASGI layers
(outermost first): Observe (metrics, access log, request id), Guard (bearer token, rate limit,
JSON-only bodies) and BodyLimit (413 before a large body is read). Every error is an RFC 9457
problem document (problems.py). HTTP cannot share the caller's database transaction: an app that
must add items atomically with its own writes uses the SQL functions instead (docs/howto/sql.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Annotated, TypeVar

import psycopg
import structlog
from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from harvester.config import Config, ack_topics
from harvester.services.http import models, problems
from harvester.services.http.backend import SqlFunctionStore, Store, StoreUnavailable, TrackerStore
from harvester.services.http.completion import CompletionWatcher
from harvester.services.http.guard import Guard, send_problem
from harvester.services.http.health import Readiness
from harvester.services.http.idempotency import Idempotency, Reply, fingerprint, key_of
from harvester.services.http.observe import Observe, metrics
from harvester.services.http.outcomes import add_outcome_routes, check_thresholds, parent_problem
from harvester.services.http.params import BatchId, IdempotencyKey, responses
from harvester.services.http.problems import Problem
from harvester.services.http.security import BodyLimit, RateLimiter, Scope, Send
from harvester.services.http.strict_json import StrictJSONRoute
from harvester.services.http.tenants import DEFAULT, TenantAuth, own, own_acked
from harvester.services.http.waits import HeldStream, WaitsPerToken
from tracker import BatchStatus
from tracker.errors import MalformedItemId, TrackerError, UnknownBatch

T = TypeVar("T")
API_VERSION = "1.1.0"
_bearer = HTTPBearer(auto_error=False, description="a token from http.tokens / http.tokens_file")


def _column(tenant: object) -> str | None:
    """The batch's tenant column: null for the default tenant (as batches opened by the Python API or SQL)."""
    name = getattr(tenant, "name", DEFAULT)
    return None if name == DEFAULT else str(name)


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (its request, a GET, has no body left to read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _expire_keys(idempotency: Idempotency, every: float = 60.0) -> None:
    """Delete expired Idempotency-Keys, a bounded chunk at a time, until none is left, every minute."""
    while True:
        while await idempotency.expire() > 0:
            await asyncio.sleep(0)
        await asyncio.sleep(every)


class Service(Observe):
    """The ASGI app create_app returns; `fastapi` is the FastAPI app inside (the server drains it,
    tests and openapi.py reach it)."""

    fastapi: FastAPI


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


def create_app(cfg: Config, store: Store | None = None, tokens: list[str] | None = None) -> Service:
    """The ASGI application. `tokens`: the bearer tokens (security.load_tokens); empty = local mode."""
    h = cfg.http
    if store is None:
        where = (cfg.database.dsn, cfg.database.schema)
        topic, size, timeout = cfg.harvester.default_completion_topic, h.pool_size, h.request_timeout
        store = (
            SqlFunctionStore(*where, completion_topic=topic, pool_size=size, timeout=timeout)
            if h.backend == "sql"
            else TrackerStore(
                *where, completion_topic=topic, pool_size=size, timeout=timeout, metrics_prefix=cfg.metrics.prefix
            )
        )
    watcher = CompletionWatcher(store.finished, h.completion_poll_interval)
    auth = TenantAuth(tokens or [], h.tenants_file, cfg.harvester.default_completion_topic)
    log = structlog.get_logger("reaper.http")
    audit = structlog.get_logger("reaper.audit")
    console = None
    if cfg.console.enabled:  # the operator's console under /console/ (harvester/services/console/)
        from harvester.services.console import Sessions, add_console, load_viewer_tokens

        sessions = Sessions(cfg.console, auth, load_viewer_tokens(cfg.console))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await store.open()
        if console is not None:
            await asyncio.to_thread(console.open)
        watcher.start()
        expiry = asyncio.create_task(_expire_keys(idempotency), name="idempotency-expiry")
        log.info("http service started", schema=cfg.database.schema, auth=bool(tokens))
        try:
            yield
        finally:
            expiry.cancel()
            await watcher.stop()
            if console is not None:
                await asyncio.to_thread(console.close)
            await store.close()
            log.info("http service stopped")

    app = FastAPI(
        title="outbox-reaper tracker API",
        version=API_VERSION,
        lifespan=lifespan,
        openapi_url="/v1/openapi.json",
        docs_url=None,
        redoc_url=None,
        description="Fan-out completion tracking over HTTP: open a batch, add items (clients expand "
        "`{group_id, start, upto}` into ids `<batch>:<group>:<index>`), close it, ack ids, "
        "and learn of completion by long-poll. Errors are RFC 9457 problem documents.",
    )
    app.router.route_class = StrictJSONRoute  # before the routes: every body is read strictly
    app.state.draining = False
    app.state.watcher = watcher
    app.state.auth = auth  # `reaper serve` reloads its tenants on SIGHUP

    def _instance(request: Request) -> str:
        return request.url.path

    def _problem(request: Request, problem: Problem) -> Response:
        request.state.problem = problem.slug
        return problems.response(problem, _instance(request))

    @app.exception_handler(Problem)
    async def on_problem(request: Request, exc: Problem) -> Response:
        return _problem(request, exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = []
        for e in exc.errors():
            loc = [str(p) for p in e.get("loc", ())]
            if e.get("type") == "json_invalid":
                errors.append({"field": "body", "message": "the body is not valid JSON"})
            else:
                errors.append({"field": ".".join(loc), "message": e.get("msg", "invalid")})
        first = errors[0] if errors else {"field": "body", "message": "invalid"}
        return _problem(
            request,
            Problem(
                "invalid-request", f"{first['field']}: {first['message']}", field=first["field"], errors=errors[:20]
            ),
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc, problems.ProblemException):
            return _problem(request, exc.problem)
        slug = {404: "not-found", 405: "method-not-allowed", 413: "payload-too-large"}.get(
            exc.status_code, "invalid-request"
        )
        detail = {
            404: f"no resource at {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
            413: f"the body is larger than {h.max_body_bytes} bytes",
        }.get(exc.status_code, str(exc.detail))
        return _problem(request, Problem(slug, detail, headers=exc.headers))

    @app.exception_handler(StoreUnavailable)
    async def on_unavailable(request: Request, exc: StoreUnavailable) -> Response:
        return _problem(
            request,
            Problem("unavailable", f"the database is unavailable ({exc}); retry later", headers={"Retry-After": "1"}),
        )

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> Response:
        request_id = request.scope.get("state", {}).get("request_id")
        log.error("unhandled error", request_id=request_id, exc_info=exc)
        return _problem(
            request, Problem("internal", f"internal error (request id {request_id})", request_id=request_id)
        )

    async def call(coro: Awaitable[T], *, batch_in_path: bool) -> T:
        try:
            return await coro
        except TrackerError as exc:
            raise problems.from_tracker(exc, batch_in_path=batch_in_path) from None

    waits = app.state.waits = WaitsPerToken(h.max_waits_per_token)
    # every ack topic of the configuration (one per outbox schema), not only the `database` one's
    reserved_topics = {*ack_topics(cfg).values(), cfg.acker.dead_letter_topic, cfg.harvester.leader_topic}
    idempotency = Idempotency(store, h.idempotency_window)

    async def respond(request: Request, work: Callable[[Store], Awaitable[Reply]]) -> Response:
        """Run a POST's work, once per Idempotency-Key when the request carries one."""
        key = key_of(request.scope)
        if key is None:
            reply, replayed = await work(store), False
        else:
            print_ = fingerprint(request.method, request.url.path, await request.body())
            reply, replayed = await idempotency.run(request.state.scope, key, print_, work)
        if reply.completed:
            watcher.notify(reply.completed)  # after the commit: a woken long-poll sees the completion
        headers = {**reply.headers, **({"Idempotent-Replayed": "true"} if replayed else {})}
        audit.info(  # one line per write, naming who did it
            "audit",
            tenant=request.state.tenant.name,
            token=request.state.token,
            method=request.method,
            path=request.url.path,
            status=reply.status,
            replayed=replayed,
            request_id=request.scope.get("state", {}).get("request_id"),
        )
        return JSONResponse(reply.doc, status_code=reply.status, headers=headers)

    v1 = [Depends(_bearer)]  # every /v1 route documents the bearer token (Guard checks it)

    @app.post(
        "/v1/batches",
        status_code=201,
        response_model=models.Batch,
        responses=responses(403, 409, 422),  # 403: a topic not allowed; 409: parent not open; 422: key reused
        tags=["batches"],
        summary="Open a batch",
        dependencies=v1,
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
        responses=responses(404, 410),
        tags=["batches"],
        summary="A batch's status",
        dependencies=v1,
    )
    async def get_status(request: Request, batch_id: BatchId) -> models.Status:
        await own(store, request.state.tenant, [batch_id])
        return _status(batch_id, await call(store.status(batch_id), batch_in_path=True))

    @app.post(
        "/v1/batches/{batch_id}/items",
        response_model=models.Added,
        responses=responses(404, 409, 410, 422),
        tags=["batches"],
        summary="Track more items; returns the groups that hold them",
        dependencies=v1,
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
        responses=responses(404, 410, 422),
        tags=["batches"],
        summary="Close a batch (no more items)",
        dependencies=v1,
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
        responses=responses(404),
        tags=["batches"],
        summary="Long-poll: answers once the batch is complete or expired, or after `wait` s",
        dependencies=v1,
    )
    async def completion(
        request: Request,
        batch_id: BatchId,
        wait: Annotated[float, Query(ge=0, description="seconds to wait at most")] = 30.0,
    ) -> models.Status | Response:
        if wait > h.long_poll_max:
            raise Problem(
                "invalid-request",
                f"wait {wait} is over this server's limit of {h.long_poll_max} s",
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
            **responses(404),
        },
        dependencies=v1,
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
            raise Problem(
                "payload-too-large",
                f"{len(ids)} ids: this server takes at most {h.max_ids_per_request} ids or runs per request",
                field="body.ids",
                limit=h.max_ids_per_request,
            )

        async def work(s: Store) -> Reply:
            await own_acked(s, request.state.tenant, ids)
            r = await call(s.ack(ids), batch_in_path=False)
            doc = models.AckResult(acked=r.acked, duplicates=r.duplicates, completed=r.completed).model_dump(
                mode="json"
            )
            return Reply(200, doc, completed=list(r.completed))

        return await respond(request, work)

    @app.post(
        "/v1/acks",
        response_model=models.AckResult,
        responses=responses(410, 422),
        tags=["acks"],
        summary="Ack item ids and runs (bulk)",
        dependencies=v1,
    )
    async def ack_bulk(request: Request, body: models.AckIds, idempotency_key: IdempotencyKey = None) -> Response:
        return await _ack(request, body.ids)

    @app.post(
        "/v1/acks/{item_id}",
        response_model=models.AckResult,
        responses=responses(410, 422),
        tags=["acks"],
        summary="Ack one item id or run",
        dependencies=v1,
    )
    async def ack_one(
        request: Request,
        item_id: Annotated[str, Path(max_length=64)],
        idempotency_key: IdempotencyKey = None,
    ) -> Response:
        if "\x00" in item_id:  # a NUL cannot reach PostgreSQL text: refused here, named like any malformed id
            raise problems.from_tracker(MalformedItemId(item_id, "holds a NUL character"), batch_in_path=False)
        return await _ack(request, [item_id])

    add_outcome_routes(app, store=store, h=h, respond=respond, call=call, dependencies=v1)
    if cfg.console.enabled:
        console = app.state.console = add_console(app, cfg, sessions)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> Response:
        return PlainTextResponse("ok\n")

    readiness = Readiness(store.ping, ttl=1.0)

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> Response:
        if app.state.draining:
            return PlainTextResponse("draining\n", status_code=503)
        if not await readiness.check():  # the database is asked at most once a second, whoever asks
            return PlainTextResponse("database unavailable\n", status_code=503)
        return PlainTextResponse("ok\n")

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict:
        # FastAPI documents a 422 HTTPValidationError on every route; this API answers invalid
        # requests with 400 problem documents instead, so that entry is dropped.
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)
            for item in doc.get("paths", {}).values():
                for op in item.values():
                    r = op.get("responses", {}).get("422")
                    if r and "HTTPValidationError" in str(r):
                        del op["responses"]["422"]
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    limiter = RateLimiter(h.rate_limit, h.rate_burst)

    async def too_large(scope: Scope, send: Send) -> None:
        async def nothing() -> dict:
            return {"type": "http.disconnect"}

        await send_problem(
            scope,
            nothing,
            send,
            Problem(
                "payload-too-large",
                f"the body is larger than {h.max_body_bytes} bytes",
                field="body",
                limit=h.max_body_bytes,
            ),
        )

    inner = BodyLimit(app, h.max_body_bytes, too_large)
    guarded = Guard(inner, auth, limiter, open_paths={"/v1/openapi.json"})
    outer = Service(guarded, metrics(cfg.metrics.prefix), log)
    outer.fastapi = app
    return outer
