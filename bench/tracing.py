"""What trace propagation costs `outbox.enqueue`, beside a baseline measured in the same run.

    python -m bench.tracing            # 20 calls of 20,000 items per mode
    python -m bench.tracing --quick    # 5 calls of 5,000

Modes (each the best of --repeats rounds, every round running each mode once in turn; items/s of
enqueue + commit):
- absent: opentelemetry cannot be imported (a subprocess with an import blocker): the baseline;
- no_span: opentelemetry installed, no active span (nothing stored);
- span: inside an SDK span (a traceparent header stored with every row);
- same_header: no opentelemetry, the same 55-byte traceparent header passed by hand: what the
  extra header costs Postgres, apart from the tracing code.
Also the harvester's per-row PRODUCER span (`harvester.trace_spans`), in rows/s of
`tracing.producer_span` with the SDK and a no-op exporter.

Connects to OUTBOX_TEST_DSN, else postgresql://postgres@127.0.0.1:55432/outbox. Uses a schema of
its own and drops it afterwards. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid

_RUN = r"""
import sys, time, json
if {block}:
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError("blocked")
    sys.meta_path.insert(0, Block())
import psycopg, tracker
from tracker import outbox, tracing
span = None
if {span}:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    trace.set_tracer_provider(TracerProvider())
    span = trace.get_tracer("bench").start_span("bench")
items = [b"x" * 100] * {n}
best = 0.0
with psycopg.connect({dsn!r}) as c:
    for _ in range({repeats}):
        started = time.perf_counter()
        for _ in range({calls}):
            if span is not None:
                from opentelemetry import trace
                with trace.use_span(span):
                    b = tracker.open_batch(c, schema={schema!r})
                    outbox.enqueue(c, b, items, topic="t", schema={schema!r})
            else:
                b = tracker.open_batch(c, schema={schema!r})
                outbox.enqueue(c, b, items, topic="t", schema={schema!r}, headers={headers!r})
            c.commit()
        best = max(best, {n} * {calls} / (time.perf_counter() - started))
        c.execute('TRUNCATE "{schema}".outbox, "{schema}".batch CASCADE')
        c.commit()
print(json.dumps({{"rate": best, "enabled": tracing.enabled()}}))
"""


def enqueue_rate(
    dsn: str, schema: str, *, block: bool, span: bool, n: int, calls: int, repeats: int, headers: dict | None = None
) -> dict:
    code = _RUN.format(
        block=block, span=span, n=n, calls=calls, repeats=repeats, dsn=dsn, schema=schema, headers=headers
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def producer_span_rate(rows: int) -> float:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from tracker import tracing

    tracer = TracerProvider().get_tracer("bench")
    keys = ["item-id", "batch-id", "traceparent"]
    values = [b"1:0:0", b"1", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"]
    started = time.perf_counter()
    for _ in range(rows):
        tracing.producer_span(tracer, "t", keys, values)
    del trace
    return rows / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, calls = (5000, 5) if args.quick else (20000, 20)
    dsn = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
    import psycopg

    from tracker import schema as schema_mod

    schema = f"bench_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(dsn, schema)
    try:
        modes: dict[str, float] = {}
        same = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
        # Interleaved: each repeat runs every mode once, so load from other processes hits all alike.
        for _ in range(args.repeats):
            for name, block, span, headers in (
                ("absent", True, False, None),
                ("no_span", False, False, None),
                ("span", False, True, None),
                ("same_header", True, False, same),
            ):
                got = enqueue_rate(dsn, schema, block=block, span=span, n=n, calls=calls, repeats=1, headers=headers)
                modes[name] = max(modes.get(name, 0.0), got["rate"])
        for name, rate in modes.items():
            print(f"enqueue {name:12} {rate:12,.0f} items/s (best of {args.repeats})")
        spans = producer_span_rate(20000 if args.quick else 100000)
        print(f"producer_span        {spans:12,.0f} rows/s")
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    print(
        json.dumps(
            {
                "bench": "tracing",
                "items_per_call": n,
                "calls": calls,
                "repeats": args.repeats,
                "enqueue_items_per_s": {k: round(v) for k, v in modes.items()},
                "ratio_no_span_vs_absent": round(modes["no_span"] / modes["absent"], 3),
                "ratio_span_vs_absent": round(modes["span"] / modes["absent"], 3),
                "ratio_span_vs_same_header": round(modes["span"] / modes["same_header"], 3),
                "producer_span_rows_per_s": round(spans),
            }
        )
    )


if __name__ == "__main__":
    main()
