"""HTTP benchmark: `python -m bench.http [--quick]`. The last line of output is one JSON object.

Starts `reaper serve` (a subprocess, its own schema, rate limit off, access logs at warning level,
tenants on, every POST with an Idempotency-Key)
against the local Postgres (OUTBOX_TEST_DSN, else the local services) and measures, in one run:

  bulk_ack        POST /v1/acks with --ids ids per request (default 10,000), --bulk-concurrency in
                  flight: acks/s (goal >= 200k)
  single_ack      POST /v1/acks/{id}, one id per request, --concurrency in flight over as many
                  batches (one batch's acks serialise on its row until commit): requests/s
  add_items       POST /v1/batches/{id}/items (count 100), one batch per client task: requests/s
  at_load         single acks offered at a fixed rate (--load-rps, default half the single_ack
                  rate just measured; open loop): p50/p99 latency at that stated load
  per_ack_direct  baseline: tracker.ack(conn, [one id]) per ack, one transaction each, no HTTP
  bulk_direct     baseline: tracker.ack(conn, 10,000 ids) per call, no HTTP
  worst_requests  the server's peak memory (VmHWM above its resident set before) for the costliest
                  requests within the limits: 100,000 ids in distinct groups at their last index,
                  and 100,000 ids of distinct small batches

The machine is shared (2 cores, Postgres and the client beside the server): compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psycopg

import tracker
from tests.support.ports import free_port
from tracker import schema as schema_mod

REPO = Path(__file__).resolve().parents[1]
DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
TOKEN = "bench-token-" + uuid.uuid4().hex


def say(msg: str) -> None:
    print(f"[bench.http] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def _tenants_file() -> Path:
    """The server runs with tenants on: the bench's token belongs to one, stored as its hash."""
    path = REPO / "bench" / "results" / "http-tenants.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    path.write_text(f"tenants:\n  bench:\n    tokens: ['sha256:{digest}']\n")
    return path


def start_server(schema: str, port: int, pool: int) -> subprocess.Popen:
    settings = {
        "REAPER_DATABASE__DSN": DSN,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_HTTP__TENANTS_FILE": str(_tenants_file()),
        "REAPER_HTTP__RATE_LIMIT": "0",
        "REAPER_HTTP__POOL_SIZE": str(pool),
        "REAPER_HTTP__MAX_BODY_BYTES": str(64 * 1024 * 1024),
    }
    return serve(settings, port, "http-server.log")


def serve(settings: dict[str, str], port: int, log_name: str) -> subprocess.Popen:
    """`reaper serve` on `port` with `settings` (REAPER_* variables; none inherited), logging
    warnings and errors to bench/results/`log_name`; returns once /readyz answers 200."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(settings)
    env.update({"REAPER_HTTP__PORT": str(port), "REAPER_LOGGING__LEVEL": "warning", "REAPER_LOGGING__FORMAT": "json"})
    log = REPO / "bench" / "results" / log_name
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"reaper serve exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("reaper serve did not become ready")


async def _batch_with(client: httpx.AsyncClient, n: int) -> tuple[int, list[str]]:
    b = (await client.post("/v1/batches", json={})).json()["batch_id"]
    ids: list[str] = []
    left = n
    while left:
        step = min(left, 1_000_000)
        r = await client.post(f"/v1/batches/{b}/items", json={"count": step})
        for g in r.json()["groups"]:
            prefix = f"{b}:{g['group_id']}:"
            ids.extend(prefix + str(i) for i in range(g["start"], g["upto"]))
        left -= step
    return b, ids


async def _run_closed_loop(bodies: list, concurrency: int, send) -> tuple[float, list[float]]:
    """Send every body with `concurrency` in flight; return (elapsed seconds, latencies)."""
    queue: asyncio.Queue = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    latencies: list[float] = []

    async def worker() -> None:
        while True:
            try:
                body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            await send(body)
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started, latencies


RETRIES = {"count": 0}


async def _post(client: httpx.AsyncClient, url: str, **kw: object) -> httpx.Response:
    """POST, retried on a transport error (a keep-alive connection the server closed just then):
    safe, as acks are idempotent. Retries are counted in the output."""
    # Every write carries an Idempotency-Key (the same one for its retries), as a careful client's would.
    headers = {**kw.pop("headers", {}), "Idempotency-Key": f'"{uuid.uuid4().hex}"'}  # type: ignore[dict-item]
    for attempt in range(3):
        try:
            return await client.post(url, headers=headers, **kw)
        except httpx.TransportError:
            if attempt == 2:
                raise
            RETRIES["count"] += 1
    raise AssertionError("unreachable")


def _expect(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 300:
        raise RuntimeError(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:300]}")
    return r


async def http_scenarios(url: str, a: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=max(a.concurrency, a.bulk_concurrency) + 4)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120, limits=limits
    ) as client:
        out: dict = {}
        # bulk acks: pre-encoded bodies of --ids fresh ids each
        _, ids = await _batch_with(client, a.bulk_requests * a.ids)
        bodies = [json.dumps({"ids": ids[i : i + a.ids]}).encode() for i in range(0, len(ids), a.ids)]
        say(f"bulk_ack: {len(bodies)} requests of {a.ids} ids, {a.bulk_concurrency} in flight")
        acked = 0

        async def send_bulk(body: bytes) -> None:
            nonlocal acked
            r = _expect(await _post(client, "/v1/acks", content=body, headers={"content-type": "application/json"}))
            acked += r.json()["acked"]

        elapsed, lat = await _run_closed_loop(bodies, a.bulk_concurrency, send_bulk)
        assert acked == len(ids), (acked, len(ids))
        out["bulk_ack"] = {
            "acks_per_s": round(acked / elapsed),
            "requests": len(bodies),
            "ids_per_request": a.ids,
            "concurrency": a.bulk_concurrency,
            "p50_ms": round(percentile(lat, 0.5) * 1000, 1),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 1),
        }
        say(f"bulk_ack: {out['bulk_ack']}")

        # single acks, closed loop, spread over --concurrency batches: acks of ONE batch serialise
        # on its row lock until commit (tracker invariant 2), so one batch measures commit latency
        ids = []
        for _ in range(a.concurrency):
            ids.extend((await _batch_with(client, max(1, a.single_requests // a.concurrency)))[1])
        ids = [x for pair in zip(*[ids[i :: a.concurrency] for i in range(a.concurrency)]) for x in pair] or ids

        async def send_one(item_id: str) -> None:
            _expect(await _post(client, f"/v1/acks/{item_id}"))

        elapsed, lat = await _run_closed_loop(ids, a.concurrency, send_one)
        out["single_ack"] = {
            "requests_per_s": round(len(ids) / elapsed),
            "requests": len(ids),
            "concurrency": a.concurrency,
            "batches": a.concurrency,
            "p50_ms": round(percentile(lat, 0.5) * 1000, 2),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        }
        say(f"single_ack: {out['single_ack']}")

        # add items: one open batch per client task (adds to one batch serialise on its row)
        batches = [(await client.post("/v1/batches", json={})).json()["batch_id"] for _ in range(a.concurrency)]
        per = max(1, a.add_requests // a.concurrency)

        async def adder(b: int, lat: list[float]) -> None:
            for _ in range(per):
                t0 = time.perf_counter()
                _expect(await _post(client, f"/v1/batches/{b}/items", json={"count": 100}))
                lat.append(time.perf_counter() - t0)

        lat = []
        t0 = time.perf_counter()
        await asyncio.gather(*(adder(b, lat) for b in batches))
        elapsed = time.perf_counter() - t0
        out["add_items"] = {
            "requests_per_s": round(len(lat) / elapsed),
            "requests": len(lat),
            "items_per_request": 100,
            "concurrency": a.concurrency,
            "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        }
        say(f"add_items: {out['add_items']}")

        # latency at a stated load: single acks offered at a fixed rate, open loop, over as many
        # batches; the rate is --load-rps, or half the closed-loop single-ack rate just measured
        rate = a.load_rps or max(1.0, out["single_ack"]["requests_per_s"] / 2)
        n = max(1, int(rate * a.load_seconds))
        ids = []
        for _ in range(a.concurrency):
            ids.extend((await _batch_with(client, max(1, n // a.concurrency)))[1])
        ids = [x for pair in zip(*[ids[i :: a.concurrency] for i in range(a.concurrency)]) for x in pair] or ids
        n = len(ids)
        lat = []
        errors = 0

        async def timed(item_id: str) -> None:
            nonlocal errors
            t = time.perf_counter()
            r = await _post(client, f"/v1/acks/{item_id}")
            if r.status_code != 200:
                errors += 1
            lat.append(time.perf_counter() - t)

        tasks = []
        start = time.perf_counter()
        for i, item_id in enumerate(ids):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(item_id)))
        await asyncio.gather(*tasks)
        achieved = n / (time.perf_counter() - start)
        out["at_load"] = {
            "offered_rps": round(rate, 1),
            "achieved_rps": round(achieved),
            "requests": n,
            "errors": errors,
            "p50_ms": round(percentile(lat, 0.5) * 1000, 2),
            "p99_ms": round(percentile(lat, 0.99) * 1000, 2),
        }
        say(f"at_load: {out['at_load']}")

        # the costliest requests within the limits, one at a time: the server's peak memory for each
        worst = {
            "distinct_groups_last_index": [f"{10**9 + i}:0:8191" for i in range(100_000)],
            "distinct_small_batches": [f"{10**9 + i}:0:3" for i in range(100_000)],
        }
        out["worst_requests"] = {}
        for name, worst_ids in worst.items():
            body = json.dumps({"ids": worst_ids}).encode()
            before = _reset_peak(a.server_pid)
            r = await _post(client, "/v1/acks", content=body, headers={"content-type": "application/json"})
            peak = _memory(a.server_pid)["VmHWM"]
            out["worst_requests"][name] = {
                "status": r.status_code,
                "body_mb": round(len(body) / 1e6, 2),
                "peak_above_rss_mb": round(max(0, peak - before) / 1024, 1),
            }
        say(f"worst_requests: {out['worst_requests']}")
        return out


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _reset_peak(pid: int) -> int:
    """Reset the process's VmHWM to its current resident set (Linux: clear_refs 5); returns it."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass  # not allowed here: the peak then reads as the lifetime high-water mark
    return _memory(pid)["VmRSS"]


def direct_baselines(schema: str, a: argparse.Namespace) -> dict:
    t = tracker.Tracker(schema=schema)
    with psycopg.connect(DSN, autocommit=True) as conn:
        b = t.open_batch(conn)
        handles = t.add_items(conn, b, a.per_ack_sample + a.ids * 3)
        ids = [i for h in handles for i in h.item_ids]
        t0 = time.perf_counter()
        for item_id in ids[: a.per_ack_sample]:
            t.ack(conn, [item_id])
        per_ack = a.per_ack_sample / (time.perf_counter() - t0)
        rest = ids[a.per_ack_sample :]
        t0 = time.perf_counter()
        for i in range(0, len(rest), a.ids):
            t.ack(conn, rest[i : i + a.ids])
        bulk = len(rest) / (time.perf_counter() - t0)
    return {
        "per_ack_direct": {"acks_per_s": round(per_ack), "acks": a.per_ack_sample},
        "bulk_direct": {"acks_per_s": round(bulk), "acks": len(rest), "ids_per_call": a.ids},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for development")
    ap.add_argument("--ids", type=int, default=10_000, help="ids per bulk ack request")
    ap.add_argument("--bulk-requests", type=int, default=60)
    ap.add_argument("--bulk-concurrency", type=int, default=4)
    ap.add_argument("--single-requests", type=int, default=3000)
    ap.add_argument("--add-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--load-rps", type=float, default=0.0, help="offered single-ack rate; 0: half the measured one")
    ap.add_argument("--load-seconds", type=float, default=10.0)
    ap.add_argument("--per-ack-sample", type=int, default=2000)
    ap.add_argument("--pool", type=int, default=8, help="server database connections")
    a = ap.parse_args(argv)
    if a.quick:
        a.bulk_requests, a.single_requests, a.add_requests, a.load_seconds, a.per_ack_sample = 10, 500, 400, 3.0, 300
    schema = f"bench_http_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(DSN, schema)
    try:
        port = free_port()
        proc = start_server(schema, port, a.pool)
        a.server_pid = proc.pid
        try:
            load_before = os.getloadavg()
            results = asyncio.run(http_scenarios(f"http://127.0.0.1:{port}", a))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        results.update(direct_baselines(schema, a))
    finally:
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(psycopg.sql.Identifier(schema)))
    bulk = results["bulk_ack"]["acks_per_s"]
    out = {
        "bench": "http",
        **results,
        "ratio_bulk_http_vs_per_ack_direct": round(bulk / results["per_ack_direct"]["acks_per_s"], 1),
        "ratio_bulk_http_vs_single_ack_http": round(bulk / results["single_ack"]["requests_per_s"], 1),
        "ratio_bulk_http_vs_bulk_direct": round(bulk / results["bulk_direct"]["acks_per_s"], 3),
        "goal_bulk_acks_per_s": 200_000,
        "transport_retries": RETRIES["count"],
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
