"""W3C trace context through the outbox (OpenTelemetry), at no cost when it is not installed.

Producer side: `outbox.enqueue` stores the active span's context in each row's headers
(`traceparent`, `tracestate`), and the harvester publishes row headers as Kafka headers, so the
records carry it; `open_batch` stores it on the batch, and the batch's completion and expiry
events carry that (the opening span's) context (the schema builds them: sql/R__events.sql).
Consumer side: `context_of(message)` gives the context a Kafka message carries, `link_of(message)`
a span link to it, and `consumer_span(message)` a CONSUMER span continuing the producer's trace.

Without the `otel` extra (opentelemetry-api) every function here returns at once: no import is
attempted again, no header is added, nothing is allocated per row. With it but no valid active
span, `outbox_headers()` is one context-variable read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

try:  # the optional extra: `pip install outbox-reaper[otel]`
    from opentelemetry import context as _otel_context
    from opentelemetry import trace as _otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    _PROPAGATOR: TraceContextTextMapPropagator | None = TraceContextTextMapPropagator()
except ImportError:  # pragma: no cover - exercised by the no-otel test in a subprocess
    _PROPAGATOR = None

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, Tracer

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
HEADERS = (TRACEPARENT, TRACESTATE)

HeaderPairs = Sequence[tuple[str, "bytes | str | None"]]


class KafkaMessage(Protocol):
    """What the consumer helpers read from a confluent-kafka Message (or anything like it)."""

    def headers(self) -> HeaderPairs | None: ...

    def topic(self) -> str | None: ...


def enabled() -> bool:
    """Whether opentelemetry-api is importable (the `otel` extra)."""
    return _PROPAGATOR is not None


def current() -> tuple[str | None, str | None]:
    """(traceparent, tracestate) of the active span, or (None, None) without one (or without otel)."""
    if _PROPAGATOR is None:
        return None, None
    if not _otel_trace.get_current_span().get_span_context().is_valid:
        return None, None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get(TRACEPARENT), carrier.get(TRACESTATE) or None


def outbox_headers(present: Sequence[bytes | str] = ()) -> list[tuple[bytes, bytes]]:
    """The active span's context as outbox header pairs (name and value as bytes), leaving out
    names the caller already set in `present`. Empty without an active span or without otel."""
    traceparent, tracestate = current()
    if traceparent is None:
        return []
    have = {p.decode() if isinstance(p, bytes) else p for p in present}
    out = []
    for name, value in ((TRACEPARENT, traceparent), (TRACESTATE, tracestate)):
        if value is not None and name not in have:
            out.append((name.encode(), value.encode()))
    return out


def _carrier(headers: HeaderPairs | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    for name, value in headers or ():
        if name in HEADERS and value is not None:
            carrier[name] = value.decode("ascii", "replace") if isinstance(value, (bytes, bytearray)) else str(value)
    return carrier


def context_from_headers(headers: HeaderPairs | None) -> Context | None:
    """The remote span context carried by W3C headers, as an OpenTelemetry Context; None if the
    headers carry none (or a malformed one), or otel is absent."""
    if _PROPAGATOR is None:
        return None
    carrier = _carrier(headers)
    if TRACEPARENT not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if _otel_trace.get_current_span(ctx).get_span_context().is_valid else None


def context_of(message: KafkaMessage) -> Context | None:
    """The trace context a consumed Kafka message carries (see `context_from_headers`)."""
    return context_from_headers(message.headers())


def link_of(message: KafkaMessage) -> Link | None:
    """A span link to the context a message carries (for batch consumers: one span, many links)."""
    ctx = context_of(message)
    if ctx is None:
        return None
    return _otel_trace.Link(_otel_trace.get_current_span(ctx).get_span_context())


@contextlib.contextmanager
def consumer_span(
    message: KafkaMessage, name: str | None = None, *, tracer: Tracer | None = None
) -> Iterator[Span | None]:
    """A CONSUMER span around processing one message, child of the producer's context it carries
    (a new trace if it carries none). Yields None, and does nothing, without otel."""
    if _PROPAGATOR is None:
        yield None
        return
    tracer = tracer or _otel_trace.get_tracer("outbox-reaper")
    topic = message.topic()
    attributes = {"messaging.system": "kafka", "messaging.operation": "process"}
    if topic:
        attributes["messaging.destination.name"] = topic
    with tracer.start_as_current_span(
        name or f"{topic or 'kafka'} process",
        context=context_of(message),
        kind=_otel_trace.SpanKind.CONSUMER,
        attributes=attributes,
    ) as span:
        yield span


def producer_span(tracer: Tracer, topic: str, header_keys: Sequence[str], header_values: Sequence[bytes]) -> None:
    """Record a PRODUCER span for one published outbox row that carries a stored trace context,
    linked to it (the harvester, when `harvester.trace_spans` is on; the span ends at once). A row
    without a context gets no span: nothing would tie it to a trace."""
    if TRACEPARENT not in header_keys:
        return
    ctx = context_from_headers([(k, v) for k, v in zip(header_keys, header_values) if k in HEADERS])
    if ctx is None:
        return
    link = _otel_trace.Link(_otel_trace.get_current_span(ctx).get_span_context())
    span = tracer.start_span(
        f"{topic} publish",
        context=_otel_context.Context(),
        kind=_otel_trace.SpanKind.PRODUCER,
        links=[link],
        attributes={"messaging.system": "kafka", "messaging.operation": "publish", "messaging.destination.name": topic},
    )
    span.end()
