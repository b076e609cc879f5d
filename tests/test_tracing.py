"""W3C trace context through the outbox, end to end with OpenTelemetry's SDK and its in-memory
exporter, through real Postgres and Kafka: enqueue stores the active span's context with each row,
the harvester publishes it as `traceparent`/`tracestate` headers (and, switched on, a PRODUCER
span linked to it), consumers continue the trace, and completion and expiry events carry the
context of the span that opened the batch. Without opentelemetry nothing is added."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from support.harness import make_config, read_messages, running, wait_until

import tracker
from harvester.config import ConfigError
from harvester.units import Harvester
from tracker import outbox, tracing
from tracker.expiry import sweep

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    exp = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exp))
    trace.set_tracer_provider(provider)  # once per process; every test of this module shares it
    return exp


@pytest.fixture
def spans(exporter):
    exporter.clear()
    return exporter


def traceparent_of(span) -> str:
    c = span.get_span_context()
    return f"00-{c.trace_id:032x}-{c.span_id:016x}-{int(c.trace_flags):02x}"


def test_trace_context_flows_from_enqueue_through_kafka_to_consumers_and_the_completion_event(
    spans, pg_dsn, schema, topics, kafka_bootstrap
):
    work, done = topics("work"), topics("done")
    tracer = trace.get_tracer("app")
    with psycopg.connect(pg_dsn) as c:
        with tracer.start_as_current_span("catalog import") as app_span:
            b = tracker.open_batch(c, user_key="cat-1", completion_topic=done, schema=schema)
            outbox.enqueue(c, b, [b"a", b"b", b"c"], topic=work, schema=schema)
            tracker.close_batch(c, b, schema=schema)
        c.commit()
        # No active span: nothing is added; a context the caller sets itself is kept as it is.
        outbox.enqueue(c, tracker.open_batch(c, schema=schema), [b"plain"], topic=work, schema=schema)
        mine = "00-11111111111111111111111111111111-2222222222222222-01"
        with tracer.start_as_current_span("other"):
            outbox.enqueue(
                c,
                tracker.open_batch(c, schema=schema),
                [b"own"],
                topic=work,
                headers={"traceparent": mine},
                schema=schema,
            )
        c.commit()
    expected = traceparent_of(app_span)

    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"), harvester={"trace_spans": True})
    with running(cfg):
        msgs = read_messages(kafka_bootstrap, work, 5, timeout=30)
        assert len(msgs) == 5
        by_value = {m.value(): m for m in msgs}
        for v in (b"a", b"b", b"c"):
            headers = dict(by_value[v].headers())
            assert headers["traceparent"].decode() == expected, headers
        assert "traceparent" not in dict(by_value[b"plain"].headers())
        assert [h for h in by_value[b"own"].headers() if h[0] == "traceparent"] == [("traceparent", mine.encode())]

        # Consumers continue the trace, one CONSUMER span per message, and ack in it.
        with psycopg.connect(pg_dsn) as c:
            for v in (b"a", b"b", b"c"):
                msg = by_value[v]
                assert tracing.link_of(msg).context.span_id == app_span.get_span_context().span_id
                with tracing.consumer_span(msg) as span:
                    assert span.get_span_context().trace_id == app_span.get_span_context().trace_id
                    tracker.ack(c, [tracker.item_id_of(msg)], schema=schema)
                    c.commit()
        [event] = read_messages(kafka_bootstrap, done, 1, timeout=30)
    assert json.loads(event.value())["batch_id"] == b.id
    assert dict(event.headers())["traceparent"].decode() == expected  # the opening span's context

    finished = spans.get_finished_spans()
    consumers = [s for s in finished if s.kind == SpanKind.CONSUMER]
    assert len(consumers) == 3
    assert all(s.parent is not None and s.parent.span_id == app_span.get_span_context().span_id for s in consumers)
    assert {s.attributes["messaging.destination.name"] for s in consumers} == {work}
    producers = [s for s in finished if s.kind == SpanKind.PRODUCER and s.name == f"{work} publish"]
    linked = [s for s in producers if any(lk.context.span_id == app_span.get_span_context().span_id for lk in s.links)]
    assert len(linked) == 3 and len(producers) == 4, [(s.name, s.links) for s in producers]  # + "own"; "plain": none
    assert all(s.parent is None for s in producers)  # a new trace per publish, linked to the stored one


def test_expiry_event_carries_the_opening_span_context(spans, conn, schema):
    with trace.get_tracer("app").start_as_current_span("open it") as span:
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 2, schema=schema)
    conn.commit()
    stored = conn.execute(f'SELECT traceparent FROM "{schema}".batch WHERE id = %s', [b.id]).fetchone()[0]
    assert stored == traceparent_of(span)
    conn.execute(f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '1 day' WHERE id = %s", [b.id])
    conn.commit()
    assert sweep(conn, schema=schema, idle_expiry=60, retention=86400).expired == 1
    keys, values = conn.execute(
        f"SELECT header_keys, header_values FROM \"{schema}\".outbox WHERE 'event' = ANY(header_keys)"
    ).fetchone()
    assert dict(zip(keys, (bytes(v).decode() for v in values)))["traceparent"] == traceparent_of(span)


def test_consumer_helpers_ignore_messages_without_a_valid_context(spans):  # the SDK provider: real spans
    class Msg:
        def __init__(self, headers):
            self._h = headers

        def headers(self):
            return self._h

        def topic(self):
            return "t"

    for headers in (None, [], [("traceparent", b"garbage")], [("item-id", b"1:0:0")]):
        assert tracing.context_of(Msg(headers)) is None and tracing.link_of(Msg(headers)) is None
        with tracing.consumer_span(Msg(headers)) as span:  # a new trace
            assert span.parent is None


def test_trace_spans_switch_needs_opentelemetry_and_without_it_nothing_is_added(pg_dsn, schema):
    # A process where opentelemetry cannot be imported: tracing is inert, enqueue adds no header,
    # and harvester.trace_spans is refused with a clear configuration error.
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        import psycopg, tracker
        from tracker import outbox, tracing
        from harvester import config
        assert not tracing.enabled() and tracing.current() == (None, None) and tracing.outbox_headers() == []
        with tracing.consumer_span(None) as span:
            assert span is None
        with psycopg.connect({pg_dsn!r}) as c:
            b = tracker.open_batch(c, schema={schema!r})
            outbox.enqueue(c, b, [b"x"], topic="t", schema={schema!r})
            print(c.execute('SELECT header_keys FROM "{schema}".outbox').fetchone()[0])
        try:
            config.load(None, environ={{"REAPER_HARVESTER__TRACE_SPANS": "true"}})
        except config.ConfigError as exc:
            print("refused:", exc)
        assert "opentelemetry" not in sys.modules
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "['item-id', 'batch-id']" in r.stdout
    assert "refused: configuration key 'harvester.trace_spans': needs OpenTelemetry" in r.stdout
    with pytest.raises(ConfigError):  # and with it, a bad value is still named
        make_config(pg_dsn, schema, "x:1", harvester={"trace_spans": "maybe"})
