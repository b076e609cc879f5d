"""Tracker benchmark: enqueue, bulk ack and storage, each beside a baseline measured in the same run.

    python -m bench.tracker            # 1,000,000 items and acks
    python -m bench.tracker --quick    # 100,000: a short run while developing
    python -m bench.tracker --baseline REF [--pairs 5] [--items 100,000]
                                       # REF's code against the working tree's, alternating in one
                                       # run: enqueue and ack rates, ratios pair by pair
                                       # (bench/tracker_baseline.py)

- enqueue: `outbox.enqueue` of N items (open batch, groups, N outbox rows with item-id/batch-id
  headers, commit) in items/s, beside a plain binary COPY of the same N rows by psycopg's
  `Copy.write_row` (ratio = enqueue / plain).
- ack: `tracker.ack` of N shuffled item ids in one call and in calls of 50,000 (what an acker
  folding a poll does), in acks/s, beside one UPDATE per ack (one transaction each) on a sample.
- fail: `tracker.fail` of the same N shuffled ids in one call and in calls of 50,000 (4 reasons in
  turn), in failures/s, interleaved with the acks above run for run, with the ratios fail / ack
  (goal: within 2x, i.e. >= 0.5).
- async: the asyncio face (`AsyncTracker` on a psycopg AsyncConnection) beside the sync face, runs
  interleaved in the same minutes: enqueue of N items and a bulk ack of N ids, with the ratios
  async / sync (goal: within 15%, i.e. >= 0.85).
- storage: batch_group table + index bytes per tracked item, in bits, for the enqueued batch
  and with ten such batches (the headline figure; a btree's two fixed pages weigh on one small
  table), and the marginal cost per item; then fillfactor 100 vs 70: size before and after 20
  passes of partial acks, HOT share of the group updates, ack rate; with --churn, the size while
  acks keep arriving for a minute per fillfactor, autovacuum on.
- outcomes storage (--outcomes-items N, default 10,000,000 in batches of 1,000,000): bits per item
  at rest once every item has its outcome (batches complete), from pg_total_relation_size of
  batch, batch_group and group_failure, with no item failed, with 1% failed under one shared
  reason, and with 1% failed each under a reason of its own; the reason texts (failure_reason)
  are counted apart as `reasons_bits_per_item`. At rest: the live rows alone (copied into fresh
  tables of the same definition); `_vacuumed`: the tables after a plain VACUUM, which on a shared
  server may keep dead versions another session's snapshot can still see. `--outcomes-only` runs
  just this part.

Every rate is the best of --repeats runs (3; 1 with --quick): the machine is shared.

Connects to OUTBOX_TEST_DSN, else brings up the local services (deploy/local/services.py). Uses a
schema of its own and drops it afterwards. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg

import tracker
from bench.tracker_storage import bench_churn, bench_fillfactor, bench_outcomes_storage, bench_storage
from tracker import apply_masks, outbox
from tracker import schema as schema_mod
from tracker.aio import AsyncTracker
from tracker.ids import fold

REPO = Path(__file__).resolve().parents[1]


def dsn() -> str:
    if os.environ.get("OUTBOX_TEST_DSN"):
        return os.environ["OUTBOX_TEST_DSN"]
    out = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "local" / "services.py"), "up", "--only", "postgres"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return next(line.split("=", 1)[1] for line in out.splitlines() if line.startswith("OUTBOX_TEST_DSN="))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def values(n: int) -> list[bytes]:
    # ~60-byte JSON payloads, distinct per item
    return [b'{"sku":"SKU-%08d","op":"reprice","price_cents":%d}' % (i, i % 9973) for i in range(n)]


def bench_enqueue(conn: psycopg.Connection, schema: str, n: int, repeats: int) -> dict:
    """Best of `repeats` for each side; the two sides alternate so both see the same machine."""
    vals = values(n)
    s = f'"{schema}"'
    plain_s = enqueue_s = float("inf")
    batch = handles = None
    for _ in range(repeats):
        # Baseline: the same rows (topic, key, value, header names, header values) by plain COPY.
        conn.execute(f"TRUNCATE {s}.outbox")
        conn.commit()
        batch_id = 10**9  # any id: the baseline only needs header bytes of the same size
        t0 = time.perf_counter()
        with conn.cursor().copy(
            f"COPY {s}.outbox (topic, key, value, header_keys, header_values) FROM STDIN (FORMAT BINARY)"
        ) as copy:
            copy.set_types(["text", "bytea", "bytea", "text[]", "bytea[]"])
            names, bid = ["item-id", "batch-id"], str(batch_id).encode()
            for i, v in enumerate(vals):
                copy.write_row(("bench", None, v, names, [b"%d:%d:%d" % (batch_id, i >> 13, i & 8191), bid]))
        conn.commit()
        plain_s = min(plain_s, time.perf_counter() - t0)
        conn.execute(f"TRUNCATE {s}.outbox, {s}.batch_group, {s}.batch CASCADE")
        conn.commit()

        t0 = time.perf_counter()
        batch = tracker.open_batch(conn, schema=schema)
        handles = outbox.enqueue(conn, batch, vals, topic="bench", schema=schema)
        conn.commit()
        enqueue_s = min(enqueue_s, time.perf_counter() - t0)
        rows = conn.execute(f"SELECT count(*) FROM {s}.outbox").fetchone()[0]
        assert rows == n, (rows, n)
    return {
        "batch": batch,
        "handles": handles,
        "result": {
            "enqueue_items": n,
            "enqueue_items_per_s": round(n / enqueue_s),
            "plain_copy_items_per_s": round(n / plain_s),
            "enqueue_vs_plain_copy": round(plain_s / enqueue_s, 3),
            "enqueue_s": round(enqueue_s, 3),
            "plain_copy_s": round(plain_s, 3),
        },
    }


def _fresh_ids(conn: psycopg.Connection, schema: str, n: int, seed: int) -> tuple[tracker.Batch, list[str]]:
    batch = tracker.open_batch(conn, schema=schema)
    handles = tracker.add_items(conn, batch, n, schema=schema)
    tracker.close_batch(conn, batch, schema=schema)
    conn.commit()
    ids = [i for h in handles for i in h.item_ids]
    random.Random(seed).shuffle(ids)  # acks arrive in any order
    return batch, ids


def bench_ack(conn: psycopg.Connection, schema: str, n: int, sample: int, repeats: int) -> dict:
    s = f'"{schema}"'
    out: dict = {}
    for label, chunk in (("one_call", n), ("calls_of_50k", 50_000)):
        best = best_fail = float("inf")
        for rep in range(repeats):  # acks and failures interleaved, run for run
            batch, ids = _fresh_ids(conn, schema, n, rep)
            t0 = time.perf_counter()
            acked = 0
            for k in range(0, n, chunk):
                r = tracker.ack(conn, ids[k : k + chunk], schema=schema)
                conn.commit()
                acked += r.acked
            best = min(best, time.perf_counter() - t0)
            assert acked == n and tracker.status(conn, batch, schema=schema).state == "complete"
            batch, ids = _fresh_ids(conn, schema, n, rep)
            t0 = time.perf_counter()
            failed = 0
            for k in range(0, n, chunk):
                reason = f"bench failure {k // chunk % 4}: upstream timed out"
                failed += tracker.fail(conn, ids[k : k + chunk], reason, schema=schema).failed
                conn.commit()
            best_fail = min(best_fail, time.perf_counter() - t0)
            status = tracker.status(conn, batch, schema=schema)
            assert failed == n and (status.state, status.failed) == ("complete", n)
        out[f"bulk_ack_{label}_acks_per_s"] = round(n / best)
        out[f"fail_{label}_failures_per_s"] = round(n / best_fail)
        out[f"fail_vs_ack_{label}"] = round(best / best_fail, 2)
    # Where the time goes: folding the ids in Python vs applying the masks in Postgres.
    fold_s = fold_cpu_s = apply_s = float("inf")
    for rep in range(repeats):
        batch, ids = _fresh_ids(conn, schema, n, 100 + rep)
        t0, c0 = time.perf_counter(), time.process_time()
        masks = fold(ids)
        t1, c1 = time.perf_counter(), time.process_time()
        apply_masks(conn, masks, schema=schema)
        conn.commit()
        t2 = time.perf_counter()
        fold_s, fold_cpu_s, apply_s = min(fold_s, t1 - t0), min(fold_cpu_s, c1 - c0), min(apply_s, t2 - t1)
    out["fold_ids_per_s"] = round(n / fold_s)
    out["fold_ids_per_cpu_s"] = round(n / fold_cpu_s)
    out["apply_masks_acks_per_s"] = round(n / apply_s)
    out["bulk_ack_ids"] = n
    out["bulk_ack_acks_per_s"] = out["bulk_ack_one_call_acks_per_s"]

    # Baseline: one UPDATE per ack, each its own transaction, on a sample.
    batch = tracker.open_batch(conn, schema=schema)
    (h,) = tracker.add_items(conn, batch, sample, schema=schema)
    conn.commit()
    idx = list(range(sample))
    random.Random(9).shuffle(idx)
    with psycopg.connect(conn.info.dsn, autocommit=True) as single:
        stmt = (
            f"UPDATE {s}.batch_group SET bits = set_bit(bits, %(i)s, 0), pending = pending - get_bit(bits, %(i)s) "
            f"WHERE batch_id = %(b)s AND id = 0"
        )
        t0 = time.perf_counter()
        for i in idx:
            single.execute(stmt, {"i": i, "b": batch.id})
        per_ack_s = time.perf_counter() - t0
    out["per_ack_update_sample"] = sample
    out["per_ack_update_acks_per_s"] = round(sample / per_ack_s)
    out["bulk_vs_per_ack_update"] = round(out["bulk_ack_acks_per_s"] / out["per_ack_update_acks_per_s"], 1)
    return out


async def _async_round(db: str, schema: str, vals: list[bytes], ids_of: int) -> tuple[float, float]:
    """One async enqueue of `vals` and one async bulk ack of a fresh batch of `ids_of` ids."""
    t = AsyncTracker(schema=schema)
    async with await psycopg.AsyncConnection.connect(db) as conn:
        t0 = time.perf_counter()
        batch = await t.open_batch(conn)
        await t.enqueue(conn, batch, vals, topic="bench")
        await conn.commit()
        enqueue_s = time.perf_counter() - t0
        acked = await t.open_batch(conn)
        handles = await t.add_items(conn, acked, ids_of)
        await t.close_batch(conn, acked)
        await conn.commit()
        ids = [i for h in handles for i in h.item_ids]
        random.Random(7).shuffle(ids)
        t0 = time.perf_counter()
        r = await t.ack(conn, ids)
        await conn.commit()
        ack_s = time.perf_counter() - t0
        assert r.acked == ids_of and r.completed == [acked.id]
    return enqueue_s, ack_s


def _sync_round(conn: psycopg.Connection, schema: str, vals: list[bytes], ids_of: int) -> tuple[float, float]:
    t = tracker.Tracker(schema=schema)
    t0 = time.perf_counter()
    batch = t.open_batch(conn)
    t.enqueue(conn, batch, vals, topic="bench")
    conn.commit()
    enqueue_s = time.perf_counter() - t0
    acked = t.open_batch(conn)
    handles = t.add_items(conn, acked, ids_of)
    t.close_batch(conn, acked)
    conn.commit()
    ids = [i for h in handles for i in h.item_ids]
    random.Random(7).shuffle(ids)
    t0 = time.perf_counter()
    r = t.ack(conn, ids)
    conn.commit()
    ack_s = time.perf_counter() - t0
    assert r.acked == ids_of and r.completed == [acked.id]
    return enqueue_s, ack_s


def bench_async(db: str, schema: str, n: int, repeats: int) -> dict:
    """Sync and async faces, alternating, best of `repeats` (at least 3) each."""
    vals = values(n)
    best = {"sync": [float("inf")] * 2, "async": [float("inf")] * 2}
    with psycopg.connect(db) as conn:
        for rep in range(max(3, repeats)):
            for face in ("sync", "async") if rep % 2 == 0 else ("async", "sync"):
                conn.execute(f'TRUNCATE "{schema}".outbox, "{schema}".batch_group, "{schema}".batch CASCADE')
                conn.commit()
                if face == "sync":
                    got = _sync_round(conn, schema, vals, n)
                else:
                    got = asyncio.run(_async_round(db, schema, vals, n))
                best[face] = [min(a, b) for a, b in zip(best[face], got)]
    out = {
        "async_enqueue_items_per_s": round(n / best["async"][0]),
        "sync_enqueue_items_per_s_same_run": round(n / best["sync"][0]),
        "async_bulk_ack_acks_per_s": round(n / best["async"][1]),
        "sync_bulk_ack_acks_per_s_same_run": round(n / best["sync"][1]),
    }
    out["async_vs_sync_enqueue"] = round(best["sync"][0] / best["async"][0], 3)
    out["async_vs_sync_bulk_ack"] = round(best["sync"][1] / best["async"][1], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tracker", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="100,000 items instead of 1,000,000, fewer repeats")
    p.add_argument("--items", type=int, help="items to enqueue and ids to ack")
    p.add_argument("--repeats", type=int, help="best of this many runs per figure (default 3, quick 1)")
    p.add_argument(
        "--churn",
        action="store_true",
        help="also ~2 minutes of sustained acking with autovacuum on, fillfactor 100 vs 70",
    )
    p.add_argument("--no-fillfactor", action="store_true", help="skip the fillfactor 100 vs 70 comparison")
    p.add_argument(
        "--outcomes-items", type=int, help="items of the outcomes storage figure (default 10,000,000, quick 1,000,000)"
    )
    p.add_argument("--outcomes-only", action="store_true", help="only the outcomes storage figure")
    p.add_argument(
        "--baseline", metavar="REF", help="compare enqueue and ack rates with commit REF's tracker, same run"
    )
    p.add_argument("--pairs", type=int, default=5, help="with --baseline: pairs of runs (default 5)")
    p.add_argument(
        "--baseline-python",
        metavar="PATH",
        help="with --baseline: the interpreter for REF (default this one; give one whose packages "
        "satisfy REF's dependencies if this one's do not)",
    )
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    if args.items is not None and args.items < 1:
        p.error("--items must be at least 1")
    if args.baseline is not None:
        from bench.tracker_baseline import bench_baseline

        n = args.items or (20_000 if args.quick else 100_000)
        got = bench_baseline(
            args.baseline,
            args.pairs,
            n,
            dsn(),
            lambda msg: log(f"[bench.tracker] {msg}"),
            args.baseline_python or sys.executable,
        )
        print(json.dumps({"bench": "tracker", "quick": args.quick, "items": n, "baseline": got}))
        return 0
    args.outcomes_items = args.outcomes_items or (1_000_000 if args.quick else 10_000_000)
    if args.outcomes_only:
        got = bench_outcomes_storage(dsn(), args.outcomes_items)
        got["bench"] = "tracker"
        got["targets"] = {"bits_per_item_with_outcomes": 2.5}
        got["targets_met"] = {"storage_with_outcomes": got["bits_per_item_with_outcomes"] <= 2.5}
        print(json.dumps(got))
        return 0
    n = args.items or (100_000 if args.quick else 1_000_000)
    repeats = args.repeats or (1 if args.quick else 3)
    sample = 1_000 if args.quick else 5_000
    db = dsn()
    name = f"bench_tracker_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(db, name)
    result: dict = {
        "bench": "tracker",
        "quick": args.quick,
        "items": n,
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "note": "shared machine: best of `repeats` wall-clock runs; compare the ratios",
    }
    try:
        with psycopg.connect(db) as conn:
            log(f"enqueue {n} items (best of {repeats}) ...")
            enq = bench_enqueue(conn, name, n, repeats)
            result.update(enq["result"])
            log(json.dumps(enq["result"]))
            st = bench_storage(conn, name, n)
            result.update(st)
            result["bits_per_item"] = st["bits_per_item_ten_batches"]
            log(json.dumps(st))
            log(f"ack {n} ids (best of {repeats}) ...")
            result.update(bench_ack(conn, name, n, sample, repeats))
        log(f"sync vs async faces, {n} items (interleaved, best of {max(3, repeats)}) ...")
        result["faces"] = bench_async(db, name, n, repeats)
        log(json.dumps(result["faces"]))
        if not args.no_fillfactor:
            log("fillfactor 100 vs 70 ...")
            result["fillfactor"] = bench_fillfactor(db, n, 20)
        if args.churn:
            log("sustained acking, fillfactor 100 vs 70 (~2 minutes) ...")
            result["churn"] = bench_churn(db, n)
        log(f"outcomes storage, {args.outcomes_items} items ...")
        result["outcomes"] = bench_outcomes_storage(db, args.outcomes_items)
    finally:
        with psycopg.connect(db, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    result["targets"] = {
        "enqueue_items_per_s": 150_000,
        "bulk_ack_acks_per_s": 1_000_000,
        "bits_per_item": 1.2,
        "bits_per_item_with_outcomes": 2.5,
        "async_vs_sync": 0.85,
        "fail_vs_ack": 0.5,
    }
    result["targets_met"] = {
        "enqueue": result["enqueue_items_per_s"] >= 150_000,
        "async_face": min(result["faces"]["async_vs_sync_enqueue"], result["faces"]["async_vs_sync_bulk_ack"]) >= 0.85,
        "bulk_ack": result["bulk_ack_acks_per_s"] >= 1_000_000,
        "storage": result["bits_per_item"] <= 1.2,
        "failures_within_2x_of_acks": min(result["fail_vs_ack_one_call"], result["fail_vs_ack_calls_of_50k"]) >= 0.5,
        "storage_with_outcomes": result["outcomes"]["bits_per_item_with_outcomes"] <= 2.5,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
