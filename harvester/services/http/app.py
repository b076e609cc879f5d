"""The tracker over HTTP (v1): batches, items, close, acks, status, completion long-poll.

`create_app(cfg, store)` builds the ASGI application: FastAPI routes inside three small ASGI layers
(outermost first): Observe (metrics, access log, request id), Guard (bearer token, rate limit,
JSON-only bodies) and BodyLimit (413 before a large body is read). Every error is an RFC 9457
problem document (problems.py). HTTP cannot share the caller's database transaction: an app that
must add items atomically with its own writes uses the SQL functions instead (docs/howto/sql.md).

This module assembles the service: the store, its lifespan, the error handlers, idempotent and audited
writes, health and metrics, the OpenAPI document and the layers; the routes of API v1 are in
routes.py, those of failures in outcomes.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from harvester.config import Config
from harvester.services.http import problems
from harvester.services.http.backend import SqlFunctionStore, Store, StoreUnavailable, TenantBusy, TrackerStore
from harvester.services.http.completion import CompletionWatcher
from harvester.services.http.guard import Guard, send_problem
from harvester.services.http.health import Readiness
from harvester.services.http.idempotency import Idempotency, Reply, fingerprint, key_of
from harvester.services.http.observe import Observe, metrics
from harvester.services.http.offload import CpuThreads
from harvester.services.http.outcomes import add_outcome_routes
from harvester.services.http.params import body_bound
from harvester.services.http.problems import Problem
from harvester.services.http.routes import add_v1_routes
from harvester.services.http.security import BodyLimit, RateLimiter, Scope, Send, WrongTokens
from harvester.services.http.strict_json import StrictJSONRoute
from harvester.services.http.tenants import TenantAuth
from harvester.services.http.token_connections import tenant_share
from harvester.services.http.waits import WaitsPerToken
from tracker.errors import TrackerError

T = TypeVar("T")
API_VERSION = "1.1.0"
_bearer = HTTPBearer(auto_error=False, description="a token from http.tokens / http.tokens_file")


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


def create_app(cfg: Config, store: Store | None = None, tokens: list[str] | None = None) -> Service:
    """The ASGI application. `tokens`: the bearer tokens (security.load_tokens); empty = local mode."""
    h = cfg.http
    if store is None:
        where = (cfg.database.dsn, cfg.database.schema)
        topic, size, timeout = cfg.harvester.default_completion_topic, h.pool_size, h.request_timeout
        share = tenant_share(h.pool_size, h.max_connections_per_tenant)  # one tenant's share of the pool
        store = (
            SqlFunctionStore(
                *where, completion_topic=topic, pool_size=size, timeout=timeout, connections_per_tenant=share
            )
            if h.backend == "sql"
            else TrackerStore(
                *where,
                completion_topic=topic,
                pool_size=size,
                timeout=timeout,
                connections_per_tenant=share,
                metrics_prefix=cfg.metrics.prefix,
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
            cpu.close()
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
    app.state.cpu = cpu = CpuThreads()  # large bodies parsed and large acks folded there (StrictRequest)
    app.state.body_bound = body_bound(h.max_ids_per_request)  # refused before the strict walk
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
        if exc.status_code == 413:  # a chunked body read past the limit (BodyLimit), as its Content-Length refusal
            return _problem(request, Problem(slug, detail, headers=exc.headers, field="body", limit=h.max_body_bytes))
        return _problem(request, Problem(slug, detail, headers=exc.headers))

    @app.exception_handler(TenantBusy)
    async def on_busy(request: Request, exc: TenantBusy) -> Response:
        return _problem(
            request,
            Problem(
                "rate-limited",
                f"{exc}: no connection came free within http.request_timeout; retry after the requests in flight",
                headers={"Retry-After": "1"},
                limit=exc.limit,
            ),
        )

    @app.exception_handler(StoreUnavailable)
    async def on_unavailable(request: Request, exc: StoreUnavailable) -> Response:
        detail = f"the database is unavailable ({exc}); retry later"
        if exc.maybe_applied and request.method == "POST":
            # cut off after it reached the database: it may have committed (the audit line says so)
            request.state.outcome = "unknown"
            detail += (
                "; this write may have been applied: retry it with the same Idempotency-Key, "
                "which applies it at most once"
            )
        return _problem(request, Problem("unavailable", detail, headers={"Retry-After": "1"}))

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
    idempotency = Idempotency(store, h.idempotency_window)

    async def respond(request: Request, work: Callable[[Store], Awaitable[Reply]]) -> Response:
        """Run a POST's work, once per Idempotency-Key when the request carries one (Observe audits it)."""
        key = key_of(request.scope)
        if key is None:
            reply, replayed = await work(store), False
        else:
            print_ = fingerprint(request.method, request.url.path, await request.body())
            reply, replayed = await idempotency.run(request.state.scope, key, print_, work)
        if reply.completed:
            watcher.notify(reply.completed)  # after the commit: a woken long-poll sees the completion
        headers = {**reply.headers, **({"Idempotent-Replayed": "true"} if replayed else {})}
        return JSONResponse(reply.doc, status_code=reply.status, headers=headers)

    v1 = [Depends(_bearer)]  # every /v1 route documents the bearer token (Guard checks it)

    add_v1_routes(app, cfg=cfg, store=store, respond=respond, call=call, watcher=watcher, waits=waits, dependencies=v1)

    add_outcome_routes(app, store=store, h=h, respond=respond, call=call, dependencies=v1)
    guesses = WrongTokens()  # wrong tokens per client address, on /v1 and the console's login alike
    if cfg.console.enabled:
        console = app.state.console = add_console(app, cfg, sessions)
        console.logins = guesses

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
    guarded = Guard(inner, auth, limiter, open_paths={"/v1/openapi.json"}, guesses=guesses)
    outer = Service(guarded, metrics(cfg.metrics.prefix), log, audit)  # audits every write, refused or not
    outer.fastapi = app
    return outer
