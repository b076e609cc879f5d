"""Issue 12 races, real Postgres, random timing (seeded; the seed is in every failure message).

1. Consumers (threads and processes; READ COMMITTED and REPEATABLE READ) ack distinct and
   overlapping items of two batches, some transactions rolled back, while another worker closes
   the batches and the reaper's settler runs. Each round: exactly one completion event per batch,
   invariant 1 exact, and across all calls every bit reported acked exactly once.
2. The same with the reaper's acker path (apply_masks with SKIP LOCKED and retry) mixed in: the
   two paths agree on counts and on the single completion.
3. N workers run exactly_once on the same items (some effects fail, some callers roll back, some
   run under REPEATABLE READ): every item's effect is committed exactly once.

ROUNDS (env ACK_RACE_ROUNDS) rounds each.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import threading
import time

import psycopg
import pytest
from test_tracker_support import invariant_violations

import tracker
from harvester.services.claim_settler import ClaimSettler
from tracker import apply_masks
from tracker.core.acks import CLAIMS_PER_CALL_MAX
from tracker.ids import fold
from tracker.settle import settle

ROUNDS = int(os.environ.get("ACK_RACE_ROUNDS", "40"))
THREADS, PROCESSES = 3, 3
SIZE = 8192 + 40  # two groups per batch: a full one and a small one


class Rollback(Exception):
    """Injected: the caller rolls its transaction back."""


def _transaction(conn: psycopg.Connection, isolation: str, body, rng: random.Random):
    """Run body(conn) in one transaction, retrying serialization failures; returns its value, or
    None if the caller (randomly) rolled it back instead of committing."""
    while True:
        try:
            if isolation != "read committed":
                conn.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation.upper()}")
            value = body(conn)
            if rng.random() < 0.1:
                raise Rollback
            conn.commit()
            return value
        except Rollback:
            conn.rollback()
            return None
        except psycopg.errors.SerializationFailure:
            conn.rollback()
            time.sleep(rng.uniform(0, 0.002))


def ack_worker(dsn: str, schema: str, jobs, results) -> None:
    """Each job: (seed, isolation, path, [(delay, ids)]); each part acked in one transaction, a
    rolled-back part is acked again later. path 'claim' = tracker.ack, 'acker' = apply_masks in
    autocommit with SKIP LOCKED, retrying what it skipped (as the reaper's acker does)."""
    # prepare_threshold=None: seen once (seed 646476034, round 8) under REPEATABLE READ retries,
    # psycopg believed a statement prepared that the server did not have ("prepared statement
    # _pg3_27 does not exist") after a serialization failure inside a pipelined round; that is the
    # driver's and psycopg's to settle (reported), not this race's subject.
    with psycopg.connect(dsn, prepare_threshold=None) as conn, psycopg.connect(dsn, autocommit=True) as auto:
        while True:
            job = jobs.get()
            if job is None:
                return
            seed, isolation, path, parts = job
            rng = random.Random(seed)
            acked = 0
            try:
                todo = list(parts)
                while todo:
                    delay, ids = todo.pop(0)
                    time.sleep(delay)
                    if path == "acker":
                        masks = fold(ids)
                        while masks:
                            r = apply_masks(auto, masks, schema=schema, skip_locked=True)
                            acked += r.acked
                            masks = r.skipped
                            if masks:
                                time.sleep(0.001)
                        continue
                    r = _transaction(conn, isolation, lambda c: tracker.ack(c, ids, schema=schema), rng)
                    if r is None:
                        todo.append((0, ids))  # rolled back: ack it again later
                    else:
                        acked += r.acked
                results.put(("ok", acked, path))
            except Exception as exc:  # reported to the test, which fails on it
                conn.rollback()
                results.put(("error", repr(exc), path))


def close_worker(dsn: str, schema: str, jobs, results) -> None:
    with psycopg.connect(dsn) as conn:
        while True:
            job = jobs.get()
            if job is None:
                return
            try:
                for delay, batch_id in job:
                    time.sleep(delay)
                    tracker.close_batch(conn, batch_id, schema=schema)
                    conn.commit()
                results.put(("ok", 0, "close"))
            except Exception as exc:
                conn.rollback()
                results.put(("error", repr(exc), "close"))


def _ids_for(rng: random.Random, batch_ids: list[int], worker: int, workers: int) -> list[str]:
    """A disjoint share of every batch (as single ids and runs) plus random overlap with the others."""
    out: list[str] = []
    for b in batch_ids:
        lo, hi = SIZE * worker // workers, SIZE * (worker + 1) // workers
        i = lo
        while i < hi:
            group, index = divmod(i, 8192)
            end = min(hi, (group + 1) * 8192, i + rng.choice([1, 1, 1, 7, 300]))
            out.append(f"{b}:{group}:{index}" if end - i == 1 else f"{b}:{group}:{index}-{end - i + index - 1}")
            i = end
        for _ in range(rng.randint(0, 20)):  # overlap: ids other workers ack too
            j = rng.randrange(SIZE)
            out.append(f"{b}:{j // 8192}:{j % 8192}")
    rng.shuffle(out)
    return out


def _size(entry: str) -> int:
    start, _, end = entry.rpartition(":")[2].partition("-")
    return int(end) - int(start) + 1 if end else 1


def _chunks(rng: random.Random, ids: list[str]) -> list[tuple[float, list[str]]]:
    """Random cuts, then every part kept within CLAIMS_PER_CALL_MAX ids, so that every call is
    a claim (a larger tracker.ack call is a bulk ack, raced in test_tracker_race.py)."""
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(2, 8)))
    parts: list[list[str]] = []
    for p in (ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])):
        cur: list[str] = []
        for entry in p:
            if cur and sum(map(_size, cur)) + _size(entry) > CLAIMS_PER_CALL_MAX:
                parts.append(cur)
                cur = []
            cur.append(entry)
        parts.append(cur)
    return [(rng.uniform(0, 0.004), p) for p in parts if p]


def settle_all(conn: psycopg.Connection, schema: str) -> None:
    """What the reaper's settler does eventually: fold every committed claim."""
    while True:
        settle(conn, schema=schema, wait=True)
        conn.commit()
        if conn.execute(f'SELECT count(*) FROM "{schema}".ack_claim').fetchone()[0] == 0:
            return


def _race(pg_dsn: str, schema: str, paths: list[str], isolations: list[str]) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results_t: queue.Queue = queue.Queue()
    results_p = ctx.Queue()
    thread_jobs = [queue.Queue() for _ in range(THREADS + 1)]
    proc_jobs = [ctx.Queue() for _ in range(PROCESSES)]
    threads = [
        threading.Thread(target=ack_worker, args=(pg_dsn, schema, q, results_t), daemon=True)
        for q in thread_jobs[:THREADS]
    ]
    threads.append(
        threading.Thread(target=close_worker, args=(pg_dsn, schema, thread_jobs[-1], results_t), daemon=True)
    )
    procs = [ctx.Process(target=ack_worker, args=(pg_dsn, schema, q, results_p), daemon=True) for q in proc_jobs]
    stop = threading.Event()
    settler = ClaimSettler(dsn=pg_dsn, schema=schema, interval=0.005)
    threads.append(threading.Thread(target=settler.run, args=(stop,), daemon=True))
    for w in [*threads, *procs]:
        w.start()
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    workers = THREADS + PROCESSES
    totals = {"claim": 0, "acker": 0, "rounds": 0}
    try:
        with psycopg.connect(pg_dsn) as conn:
            for round_no in range(ROUNDS):
                batch_ids = []
                for _ in range(2):
                    b = tracker.open_batch(conn, schema=schema)
                    tracker.add_items(conn, b, SIZE, schema=schema)
                    batch_ids.append(b.id)
                conn.commit()
                for w, q in enumerate([*thread_jobs[:THREADS], *proc_jobs]):
                    job = (
                        rng.randrange(1 << 30),
                        rng.choice(isolations),
                        paths[w % len(paths)],
                        _chunks(rng, _ids_for(rng, batch_ids, w, workers)),
                    )
                    q.put(job)
                thread_jobs[-1].put([(rng.uniform(0, 0.03), b) for b in rng.sample(batch_ids, 2)])
                got = [results_t.get(timeout=180) for _ in range(THREADS + 1)]
                got += [results_p.get(timeout=180) for _ in range(PROCESSES)]
                context = f"round {round_no} (seed {seed})"
                assert [g for g in got if g[0] != "ok"] == [], context
                settle_all(conn, schema)
                acked = {p: sum(g[1] for g in got if g[2] == p) for p in ("claim", "acker")}
                if "acker" not in paths:
                    assert acked["claim"] == 2 * SIZE, context  # every bit reported acked exactly once
                else:  # a consumer's claim may be settled after the acker cleared its bit: both report it
                    assert acked["claim"] + acked["acker"] >= 2 * SIZE, context
                for p in ("claim", "acker"):
                    totals[p] += acked[p]
                rows = conn.execute(
                    f'SELECT b.id, b.state, b.pending, (SELECT count(*) FROM "{schema}".outbox o '
                    f"WHERE o.topic = 'batch-completions' AND o.key = convert_to(b.id::text, 'UTF8')) "
                    f'FROM "{schema}".batch b WHERE b.id = ANY(%s) ORDER BY b.id',
                    [batch_ids],
                ).fetchall()
                assert rows == [(b, "complete", 0, 1) for b in sorted(batch_ids)], context
                assert invariant_violations(conn, schema) == [], context
                conn.rollback()
                totals["rounds"] += 1
    finally:
        stop.set()
        for q in [*thread_jobs, *proc_jobs]:
            q.put(None)
        for w in [*threads, *procs]:
            w.join(timeout=30)
    totals["settler"] = settler.stats
    return totals


@pytest.mark.xdist_group("ack-race")
@pytest.mark.timeout(1200)
def test_consumers_acking_one_batch_while_it_closes_complete_it_exactly_once(pg_dsn, schema):
    totals = _race(pg_dsn, schema, ["claim"], ["read committed", "read committed", "repeatable read"])
    print(totals)
    assert totals["rounds"] == ROUNDS


@pytest.mark.xdist_group("ack-race")
@pytest.mark.timeout(1200)
def test_consumer_claims_and_the_acker_path_agree(pg_dsn, schema):
    totals = _race(pg_dsn, schema, ["claim", "acker"], ["read committed"])
    print(totals)
    assert totals["rounds"] == ROUNDS and totals["acker"] > 0 and totals["claim"] > 0


# ---------------------------------------------------------------- exactly_once on the same items


class EffectFailed(Exception):
    pass


def exactly_once_worker(dsn: str, schema: str, jobs, results) -> None:
    """Each job: (seed, isolation, worker, items): process every item (a failed effect or a
    rolled-back transaction leaves it to be processed again) until a committed call has seen it."""
    with psycopg.connect(dsn) as conn:
        while True:
            job = jobs.get()
            if job is None:
                return
            seed, isolation, worker, items = job
            rng = random.Random(seed)
            first = 0
            try:
                todo = list(items)
                while todo:
                    item = todo.pop(0)

                    def effect(c: psycopg.Connection) -> int:
                        c.execute(f'INSERT INTO "{schema}".effects (item, worker) VALUES (%s, %s)', [item, worker])
                        time.sleep(rng.uniform(0, 0.003))
                        if rng.random() < 0.1:
                            raise EffectFailed(item)
                        return worker

                    def body(c: psycopg.Connection):
                        try:
                            return tracker.exactly_once(c, item, effect, schema=schema)
                        except EffectFailed:
                            return "failed"  # the caller's transaction is intact; it commits the rest

                    r = _transaction(conn, isolation, body, rng)
                    if r is None or r == "failed":
                        todo.append(item)
                    elif r.first_time:
                        first += 1
                results.put(("ok", first))
            except Exception as exc:
                conn.rollback()
                results.put(("error", repr(exc)))


@pytest.mark.xdist_group("ack-race")
@pytest.mark.timeout(1200)
def test_exactly_once_on_the_same_items_runs_each_effect_once(pg_dsn, schema):
    ctx = multiprocessing.get_context("spawn")
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".effects (item text NOT NULL, worker int NOT NULL)')
    results_t: queue.Queue = queue.Queue()
    results_p = ctx.Queue()
    thread_jobs = [queue.Queue() for _ in range(THREADS)]
    proc_jobs = [ctx.Queue() for _ in range(PROCESSES)]
    threads = [
        threading.Thread(target=exactly_once_worker, args=(pg_dsn, schema, q, results_t), daemon=True)
        for q in thread_jobs
    ]
    procs = [
        ctx.Process(target=exactly_once_worker, args=(pg_dsn, schema, q, results_p), daemon=True) for q in proc_jobs
    ]
    stop = threading.Event()
    settler = ClaimSettler(dsn=pg_dsn, schema=schema, interval=0.005)
    threads.append(threading.Thread(target=settler.run, args=(stop,), daemon=True))
    for w in [*threads, *procs]:
        w.start()
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    isolations = ["read committed", "read committed", "repeatable read", "serializable"]
    try:
        with psycopg.connect(pg_dsn) as conn:
            for round_no in range(ROUNDS):
                b = tracker.open_batch(conn, schema=schema)
                (h,) = tracker.add_items(conn, b, rng.randint(1, 6), schema=schema)
                if rng.random() < 0.5:  # else closed while the effects run
                    tracker.close_batch(conn, b, schema=schema)
                conn.commit()
                for w, q in enumerate([*thread_jobs, *proc_jobs]):
                    items = list(h.item_ids)
                    rng.shuffle(items)
                    q.put((rng.randrange(1 << 30), rng.choice(isolations), w, items))
                if not tracker.status(conn, b, schema=schema).closed_at:
                    time.sleep(rng.uniform(0, 0.01))
                    tracker.close_batch(conn, b, schema=schema)
                    conn.commit()
                got = [results_t.get(timeout=180) for _ in range(THREADS)]
                got += [results_p.get(timeout=180) for _ in range(PROCESSES)]
                context = f"round {round_no} (seed {seed})"
                assert [g for g in got if g[0] != "ok"] == [], context
                assert sum(g[1] for g in got) == len(h.item_ids), context  # one first_time per item
                settle_all(conn, schema)
                effects = conn.execute(
                    f'SELECT item, count(*) FROM "{schema}".effects WHERE item LIKE %s GROUP BY item ORDER BY item',
                    [f"{b.id}:%"],
                ).fetchall()
                assert effects == [(i, 1) for i in sorted(h.item_ids)], context
                st = tracker.status(conn, b, schema=schema)
                events = conn.execute(
                    f'SELECT count(*) FROM "{schema}".outbox WHERE topic = %s AND key = %s',
                    ["batch-completions", str(b.id).encode()],
                ).fetchone()[0]
                assert (st.state, st.pending, events) == ("complete", 0, 1), context
                assert invariant_violations(conn, schema) == [], context
                conn.rollback()
    finally:
        stop.set()
        for q in [*thread_jobs, *proc_jobs]:
            q.put(None)
        for w in [*threads, *procs]:
            w.join(timeout=30)
