"""Consumers at scale: `python -m bench.consumers [--quick] [--acker N]`. Last line: one JSON object.

Against the local Postgres (OUTBOX_TEST_DSN, else the local services). Workers are processes
(spawned, started behind a barrier so start-up is not timed), each with its own connection:

  exactly_once   one closed batch of 100 items per worker, at least 400; W workers take ids from a
                 shared queue and call `tracker.exactly_once(conn, id, effect)`, the effect
                 inserting a row and sleeping 20 ms, then commit. items/s at W = 1, 4, 16 and the
                 ratio 16-vs-1. Every item's effect must be committed exactly once (checked).
                 16 workers on 400 items (25 each, 0.7 s) are timed too, the first size these were
                 measured at: there the start and the last worker's tail weigh several times more than
                 in the 1-worker run, so that figure is reported beside the ratio, not in it.
  single_acks    one closed batch; 16 workers each ack single ids of their own share with
                 `tracker.ack` and commit each, for a fixed time. acks/s.
  completion     200 closed batches of 20 items; 16 workers ack single ids in random order, commit
                 each and record the commit's return time; a watcher polls the outbox every ~1 ms.
                 Latency = completion row first seen - the batch's last ack commit. p50/p99/max.
  (library path: a harvester.services.claim_settler.ClaimSettler runs beside the workers in a process of its own, as
  in `reaper run`.)
  acker          (--acker N > 0) bench.acks' single_id scenario: N single-id ack messages
                 through one `reaper run` acker.
  inbox          (unless --inbox off) bench.inbox: messages/s of plain consumption and of
                 inbox-checked consumption (tracker.inbox.run_once) with 1 and 16 consumers, the
                 cleanup's cost (a partition dropped against a DELETE + VACUUM of its ids) and the
                 bytes per id at rest. `--inbox only` runs it alone (seconds).

`--path direct` runs the consumer scenarios through `tracker.core.acks.apply_masks` inside the
caller's transaction (batch rows locked until commit: the behaviour before ack claims), so a
before/after pair can be measured in one run (`--path both`). The machine is shared: compare
ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
import uuid

import psycopg

import tracker
from tracker import schema as schema_mod

DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
EFFECT_SECONDS = 0.020
SETTLE_INTERVAL = 0.01  # the reaper's settler default


def say(msg: str) -> None:
    print(f"[bench.consumers] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the two paths


def _direct_ack(conn: psycopg.Connection, ids: list[str], schema: str) -> tracker.AckResult:
    return tracker.apply_masks(conn, tracker.fold(ids), schema=schema)


def _direct_exactly_once(conn: psycopg.Connection, item_id: str, effect, schema: str) -> bool:
    """The pre-issue-12 exactly_once: the locking ack first, then the effect, one savepoint."""
    with conn.transaction():  # a savepoint of the worker's transaction
        if _direct_ack(conn, [item_id], schema).acked == 0:
            return False
        effect(conn)
    return True


def _ack(path: str, conn: psycopg.Connection, ids: list[str], schema: str) -> tracker.AckResult:
    return _direct_ack(conn, ids, schema) if path == "direct" else tracker.ack(conn, ids, schema=schema)


def _exactly_once(path: str, conn: psycopg.Connection, item_id: str, effect, schema: str) -> bool:
    if path == "direct":
        return _direct_exactly_once(conn, item_id, effect, schema)
    return tracker.exactly_once(conn, item_id, effect, schema=schema).first_time


# ---------------------------------------------------------------- workers (run in child processes)


def eo_worker(path: str, schema: str, jobs, barrier, out) -> None:
    def effect(conn: psycopg.Connection) -> None:
        conn.execute(f'INSERT INTO "{schema}".bench_effect (item) VALUES (%s)', [current])
        time.sleep(EFFECT_SECONDS)

    done = dups = 0
    with psycopg.connect(DSN) as conn:
        barrier.wait()
        while True:
            # Blocking get, ended by a sentinel: multiprocessing's get_nowait() raises Empty whenever
            # another worker holds the queue's read lock, which made workers quit early (the
            # figures before 2026-11-23 measured fewer workers than they named).
            current = jobs.get(timeout=60)
            if current is None:
                break
            if _exactly_once(path, conn, current, effect, schema):
                done += 1
            else:
                dups += 1
            conn.commit()
    out.put((done, dups))


def ack_worker(path: str, schema: str, ids: list[str], seconds: float, barrier, out) -> None:
    n = acked = 0
    with psycopg.connect(DSN) as conn:
        barrier.wait()
        deadline = time.monotonic() + seconds
        for item in ids:
            if time.monotonic() >= deadline:
                break
            acked += _ack(path, conn, [item], schema).acked
            conn.commit()
            n += 1
    out.put((n, acked))


def latency_worker(path: str, schema: str, ids: list[str], barrier, out) -> None:
    last: dict[int, float] = {}
    with psycopg.connect(DSN) as conn:
        barrier.wait()
        for item in ids:
            _ack(path, conn, [item], schema)
            conn.commit()
            b = int(item.split(":", 1)[0])
            last[b] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on Linux
    out.put(last)


def settler_process(schema: str, stop) -> None:
    from harvester.services.claim_settler import ClaimSettler

    ClaimSettler(dsn=DSN, schema=schema, interval=SETTLE_INTERVAL).run(stop)


# ---------------------------------------------------------------- scenarios


class Env:
    def __init__(self) -> None:
        self.schema = f"bench_{uuid.uuid4().hex[:10]}"
        schema_mod.migrate(DSN, self.schema)
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'CREATE TABLE "{self.schema}".bench_effect (item text NOT NULL)')

    def close(self) -> None:
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE')

    def batch(self, n: int) -> tuple[int, list[str]]:
        with psycopg.connect(DSN) as c:
            b = tracker.open_batch(c, schema=self.schema)
            ids = [i for h in tracker.add_items(c, b, n, schema=self.schema) for i in h.item_ids]
            tracker.close_batch(c, b, schema=self.schema)
        return b.id, ids


CTX = mp.get_context("spawn")


def _run(target, args_per_worker: list[tuple]) -> tuple[float, list]:
    """Start one process per args tuple behind a barrier; time from the barrier to the last result."""
    barrier = CTX.Barrier(len(args_per_worker) + 1)
    out = CTX.Queue()
    procs = [CTX.Process(target=target, args=(*a, barrier, out), daemon=True) for a in args_per_worker]
    for p in procs:
        p.start()
    barrier.wait(120)
    started = time.monotonic()
    results = [out.get(timeout=600) for _ in procs]
    elapsed = time.monotonic() - started
    for p in procs:
        p.join(30)
    return elapsed, results


def _settled(env: Env, batch_id: int, timeout: float = 10.0) -> None:
    """Claims whose commit found the batch row busy are folded by the settler: wait for it."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(DSN, autocommit=True) as c:
        while time.monotonic() < deadline:
            if c.execute(f'SELECT pending FROM "{env.schema}".batch WHERE id = %s', [batch_id]).fetchone()[0] == 0:
                return
            time.sleep(0.005)


def exactly_once_scenario(env: Env, path: str, workers: int, n: int = 400) -> dict:
    batch_id, ids = env.batch(n)
    jobs = CTX.Queue()
    for i in ids:
        jobs.put(i)
    for _ in range(workers):
        jobs.put(None)  # one end marker per worker
    elapsed, results = _run(eo_worker, [(path, env.schema, jobs) for _ in range(workers)])
    done = sum(r[0] for r in results)
    _settled(env, batch_id)
    with psycopg.connect(DSN) as c:
        rows, distinct = c.execute(
            f'SELECT count(*), count(DISTINCT item) FROM "{env.schema}".bench_effect WHERE item LIKE %s',
            [f"{batch_id}:%"],
        ).fetchone()
        state, pending = c.execute(
            f'SELECT state, pending FROM "{env.schema}".batch WHERE id = %s', [batch_id]
        ).fetchone()
    ok = done == n and rows == n and distinct == n and state == "complete" and pending == 0
    if not ok:
        raise RuntimeError(
            f"exactly_once {path} x{workers}: done {done}, effects {rows} ({distinct} distinct), "
            f"state {state}, pending {pending}"
        )
    return {"workers": workers, "items": n, "seconds": round(elapsed, 3), "items_per_s": round(n / elapsed, 1)}


def single_acks_scenario(env: Env, path: str, workers: int = 16, seconds: float = 4.0, n: int = 60_000) -> dict:
    _batch_id, ids = env.batch(n)
    random.Random(3).shuffle(ids)
    shares = [ids[w::workers] for w in range(workers)]
    elapsed, results = _run(ack_worker, [(path, env.schema, share, seconds) for share in shares])
    acks = sum(r[0] for r in results)
    acked = sum(r[1] for r in results)
    if acked != acks:
        raise RuntimeError(f"single acks {path}: {acks} distinct ids acked but {acked} bits reported cleared")
    return {"workers": workers, "acks": acks, "seconds": round(elapsed, 3), "acks_per_s": round(acks / elapsed)}


def completion_scenario(env: Env, path: str, workers: int = 16, batches: int = 60, per_batch: int = 20) -> dict:
    ids: list[str] = []
    batch_ids: list[int] = []
    for _ in range(batches):
        b, batch_items = env.batch(per_batch)
        batch_ids.append(b)
        ids.extend(batch_items)
    random.Random(5).shuffle(ids)
    seen: dict[int, float] = {}
    stop = threading.Event()

    def watch() -> None:
        with psycopg.connect(DSN, autocommit=True) as c:
            # Every poll reads all completion rows: ids are taken at insert and commit out of order.
            q = f'SELECT key FROM "{env.schema}".outbox WHERE topic = %s AND key = ANY(%s)'
            while not stop.is_set() or len(seen) < batches:
                keys = [str(b).encode() for b in batch_ids if b not in seen]
                for (key,) in c.execute(q, ["batch-completions", keys]).fetchall():
                    seen.setdefault(int(key.decode()), time.monotonic())
                if stop.is_set() and time.monotonic() > give_up:
                    return
                time.sleep(0.001)

    give_up = float("inf")
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    elapsed, results = _run(latency_worker, [(path, env.schema, ids[w::workers]) for w in range(workers)])
    give_up = time.monotonic() + 10
    stop.set()
    watcher.join(15)
    last: dict[int, float] = {}
    for r in results:
        for b, t in r.items():
            last[b] = max(last.get(b, 0.0), t)
    if set(seen) != set(last):
        raise RuntimeError(f"completion {path}: {len(last)} batches acked, {len(seen)} completion rows seen")
    lat = sorted(max(0.0, seen[b] - last[b]) * 1000 for b in last)
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return {
        "batches": batches,
        "items_per_batch": per_batch,
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(p99, 2),
        "max_ms": round(lat[-1], 2),
        "acks_per_s": round(len(ids) / elapsed),
    }


def consumer_figures(path: str, quick: bool) -> dict:
    env = Env()
    stop_settler = CTX.Event()
    settler = None
    try:
        if path == "library":
            # What `reaper run` hosts, in a process of its own as there (not a thread beside this
            # process's watcher): settles claims whose commit found the batch row busy.
            settler = CTX.Process(target=settler_process, args=(env.schema, stop_settler), daemon=True)
            settler.start()
        eo = {}
        for w in (1, 4, 16):
            eo[w] = exactly_once_scenario(env, path, w, n=100 if quick and w == 1 else max(400, 100 * w))
            say(f"{path} exactly_once x{w}: {eo[w]}")
        eo_short = exactly_once_scenario(env, path, 16, n=400)
        say(f"{path} exactly_once x16, 400 items: {eo_short}")
        acks = single_acks_scenario(env, path, seconds=2.0 if quick else 4.0)
        say(f"{path} single acks x16: {acks}")
        comp = completion_scenario(env, path, batches=40 if quick else 200)
        say(f"{path} completion: {comp}")
    finally:
        stop_settler.set()
        if settler is not None:
            settler.join(30)
        env.close()
    return {
        "exactly_once": {str(w): r["items_per_s"] for w, r in eo.items()},
        "exactly_once_16_vs_1": round(eo[16]["items_per_s"] / eo[1]["items_per_s"], 2),
        "exactly_once_16_400_items": eo_short["items_per_s"],
        "single_acks_16_per_s": acks["acks_per_s"],
        "completion_p50_ms": comp["p50_ms"],
        "completion_p99_ms": comp["p99_ms"],
        "completion_max_ms": comp["max_ms"],
        "detail": {"exactly_once": eo, "exactly_once_16_400_items": eo_short, "single_acks": acks, "completion": comp},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs, for development")
    ap.add_argument(
        "--path",
        choices=["library", "direct", "both"],
        default="library",
        help="library: tracker.ack / tracker.exactly_once as shipped; direct: the locking "
        "apply_masks path in the caller's transaction (the behaviour before ack claims)",
    )
    ap.add_argument("--acker", type=int, default=1_000_000, help="single-id acks through the reaper's acker (0: skip)")
    ap.add_argument("--inbox", choices=["on", "off", "only"], default="on", help="the inbox figures (bench.inbox)")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    out: dict = {
        "bench": "consumers",
        "quick": args.quick,
        "effect_ms": EFFECT_SECONDS * 1000,
        "loadavg_start": [round(x, 2) for x in load],
    }
    if args.inbox != "off":
        from bench import inbox as bench_inbox

        got = bench_inbox.figures(args.quick)
        out["inbox"] = got
        for k in ("ratio_inbox_vs_plain_1", "ratio_inbox_vs_plain_16", "ratio_cleanup_delete_vs_drop_time"):
            out[k] = got[k]
        if args.inbox == "only":
            out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
            print(json.dumps(out))
            return 0
    paths = ["direct", "library"] if args.path == "both" else [args.path]
    for path in paths:
        out[path] = consumer_figures(path, args.quick)
    if args.acker > 0:
        from bench import acks as bench_acks

        single = bench_acks.scenario("single_id", args.acker, bench_acks.produce_single)
        out["acker_single_id_acks_per_s"] = single["acks_per_s"]
        out["acker_single_id"] = single
    if args.path == "both":
        d, lib = out["direct"], out["library"]
        out["ratio_exactly_once_16_library_vs_direct"] = round(lib["exactly_once"]["16"] / d["exactly_once"]["16"], 2)
        out["ratio_single_acks_library_vs_direct"] = round(lib["single_acks_16_per_s"] / d["single_acks_16_per_s"], 2)
    main_path = out[paths[-1]]
    out["goals"] = {
        "exactly_once_16_vs_1_ge_12": main_path["exactly_once_16_vs_1"] >= 12,
        "exactly_once_1_worker_ge_40": main_path["exactly_once"]["1"] >= 40,
        "completion_p99_le_50ms": main_path["completion_p99_ms"] <= 50,
        **({"acker_ge_500k": out["acker_single_id_acks_per_s"] >= 500_000} if args.acker > 0 else {}),
    }
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
