"""Prometheus metrics and structlog access logs of the HTTP service (one ASGI middleware).

Metrics (prefix = metrics.prefix): `<p>_http_requests_total{method,route,status}`,
`<p>_http_request_duration_seconds{method,route}` (histogram), `<p>_http_errors_total{route,problem}`
(every problem document sent) and `<p>_http_requests_in_flight`. `route` is the path template
(`/v1/batches/{batch_id}`), never the raw path, so label values stay few.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, MutableMapping, Sequence

import structlog
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from harvester.services.http.security import Message, Receive, Scope, Send, headers_of, state_of

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_QUIET = {"/healthz", "/readyz", "/metrics"}
_lock = threading.Lock()
_instances: dict[str, HttpMetrics] = {}


class HttpMetrics:
    def __init__(self, prefix: str, registry: CollectorRegistry = REGISTRY) -> None:
        p, r = prefix, registry
        self.requests = Counter(
            f"{p}_http_requests_total",
            "HTTP requests served by reaper serve",
            ["method", "route", "status"],
            registry=r,
        )
        self.duration = Histogram(
            f"{p}_http_request_duration_seconds",
            "HTTP request latency in reaper serve, first byte in to last out",
            ["method", "route"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            f"{p}_http_errors_total",
            "Problem documents reaper serve sent, by problem type",
            ["route", "problem"],
            registry=r,
        )
        self.in_flight = Gauge(f"{p}_http_requests_in_flight", "HTTP requests reaper serve is serving", registry=r)


def metrics(prefix: str = "reaper") -> HttpMetrics:
    with _lock:
        if prefix not in _instances:
            _instances[prefix] = HttpMetrics(prefix)
        return _instances[prefix]


def route_of(scope: Scope) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


# Label values come from a closed set: an invented method must not create a series.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def method_of(scope: Scope) -> str:
    method = scope.get("method")
    return method if isinstance(method, str) and method in _METHODS else "other"


class Observe:
    """Request id, latency and status of every request: one metric update and one access-log event;
    and one audit line (`audit`) for every write a token made (a POST under /v1/ that Guard let
    through as a caller), with its final status, refused or not."""

    def __init__(
        self,
        app: Callable,
        m: HttpMetrics,
        log: structlog.typing.FilteringBoundLogger,
        audit: structlog.typing.FilteringBoundLogger | None = None,
    ) -> None:
        self.app, self.m, self.log, self.audit = app, m, log, audit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = uuid.uuid4().hex[:16]
        state = state_of(scope)
        state["request_id"] = request_id
        status = 500
        size = 0
        audited = False

        async def send_wrapper(message: Message) -> None:
            nonlocal status, size, audited
            if message["type"] == "http.response.start":
                code = message["status"]
                assert isinstance(code, int), "ASGI: the status is an int"
                status = int(code)
                headers = list(headers_of(message))
                # before the client can see the answer: a line for each write it saw answered
                self._audit(scope, state, status, (b"idempotent-replayed", b"true") in headers)
                audited = True
                headers.append((b"x-request-id", request_id.encode()))
                message["headers"] = headers
            elif message["type"] == "http.response.body":
                size += len(message.get("body", b""))  # type: ignore[arg-type]
            await send(message)

        self.m.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.m.in_flight.dec()
            elapsed = time.perf_counter() - started
            route, method = route_of(scope), method_of(scope)
            self.m.requests.labels(method, route, str(status)).inc()
            self.m.duration.labels(method, route).observe(elapsed)
            problem = state.get("problem")
            if problem:
                self.m.errors.labels(route, problem).inc()
            client = scope.get("client")
            fields = dict(
                request_id=request_id,
                method=method,
                route=route,
                path=scope.get("path"),
                status=status,
                duration_ms=round(elapsed * 1000, 3),
                bytes=size,
                token=state.get("token"),
                client=client[0] if isinstance(client, Sequence) and client else None,
                problem=problem,
            )
            if not audited:  # no answer was sent (the client left, or a crash before one)
                self._audit(scope, state, status, False)
            if status >= 500:
                self.log.error("http request", **fields)
            elif route in _QUIET and status < 400:
                self.log.debug("http request", **fields)  # probes and scrapes are not news
            else:
                self.log.info("http request", **fields)

    def _audit(self, scope: Scope, state: MutableMapping[str, object], status: int, replayed: bool) -> None:
        tenant = state.get("tenant")
        path = scope.get("path")
        if self.audit is None or tenant is None or scope.get("method") != "POST":
            return
        if not (isinstance(path, str) and path.startswith("/v1/")):
            return
        self.audit.info(  # one line per write, naming who did it, whatever became of it
            "audit",
            tenant=getattr(tenant, "name", None),
            token=state.get("token"),
            method="POST",
            path=path,
            status=status,
            replayed=replayed,
            outcome=_outcome(state, status, replayed),
            problem=state.get("problem"),
            request_id=state.get("request_id"),
        )


def _outcome(state: MutableMapping[str, object], status: int, replayed: bool) -> str:
    """What became of a write: applied, replayed (a retry's stored answer), refused (4xx, nothing
    changed), not-applied (503 before it reached the database, or rolled back), or unknown (cut
    off after it reached the database, a crash, or no answer sent: it may have committed)."""
    if isinstance(state.get("outcome"), str):
        return str(state["outcome"])
    if replayed:
        return "replayed"
    if 200 <= status < 300:
        return "applied"
    if 400 <= status < 500:
        return "refused"
    return "not-applied" if status == 503 else "unknown"
