"""Storage figures of bench.tracker: bits per tracked item (fresh, with ten batches, marginal),
fillfactor 100 against 70 under partial acks (and, with --churn, under a minute of acking with
autovacuum on), and the outcome tables' bits per item at rest. The module docstring of
bench/tracker.py says what each measures.
"""

from __future__ import annotations

import json
import random
import sys
import time
import uuid

import psycopg

import tracker
from tracker import schema as schema_mod


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def storage_bits(conn: psycopg.Connection, schema: str, items: int) -> dict[str, float]:
    s = f'"{schema}"'
    heap, index, batch = conn.execute(
        f"SELECT pg_relation_size('{s}.batch_group'), pg_indexes_size('{s}.batch_group'), "
        f"pg_relation_size('{s}.batch') + pg_indexes_size('{s}.batch')"
    ).fetchone()
    return {
        "bits_per_item": round((heap + index) * 8 / items, 4),
        "bits_per_item_with_batch_table": round((heap + index + batch) * 8 / items, 4),
        "group_heap_bytes": heap,
        "group_index_bytes": index,
    }


def bench_fillfactor(db: str, n: int, rounds: int) -> dict:
    """The same n items tracked at fillfactor 100 and 70 and acked in `rounds` passes of random ids
    (every pass updates every group once, in one transaction), without and with a VACUUM after
    each pass (what a prompt autovacuum does): table size at rest and at its largest, HOT share of
    the group updates, ack rate."""
    out = {}
    for ff in (100, 70):
        for vacuum in (False, True):
            name = f"bench_ff{ff}_{uuid.uuid4().hex[:8]}"
            schema_mod.migrate(db, name)
            try:
                with psycopg.connect(db) as conn, psycopg.connect(db, autocommit=True) as maint:
                    conn.execute(f'ALTER TABLE "{name}".batch_group SET (fillfactor = {ff}, autovacuum_enabled = off)')
                    batch = tracker.open_batch(conn, schema=name)
                    handles = tracker.add_items(conn, batch, n, schema=name)
                    conn.commit()
                    fresh = storage_bits(conn, name, n)["bits_per_item"]
                    ids = [i for h in handles for i in h.item_ids]
                    random.Random(ff).shuffle(ids)
                    per = len(ids) // rounds
                    largest, elapsed = fresh, 0.0
                    for k in range(rounds):
                        t0 = time.perf_counter()
                        tracker.ack(conn, ids[k * per : (k + 1) * per], schema=name)
                        conn.commit()
                        elapsed += time.perf_counter() - t0
                        if vacuum:
                            maint.execute(f'VACUUM "{name}".batch_group')
                        largest = max(largest, storage_bits(conn, name, n)["bits_per_item"])
                    conn.execute("SELECT pg_stat_force_next_flush()")
                    conn.commit()
                    time.sleep(0.5)
                    upd, hot = conn.execute(
                        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE schemaname = %s "
                        "AND relname = 'batch_group'",
                        [name],
                    ).fetchone()
                    out[f"ff{ff}{'_vacuum_each_pass' if vacuum else '_no_vacuum'}"] = {
                        "bits_per_item_at_rest": fresh,
                        "bits_per_item_largest": largest,
                        "group_updates": upd,
                        "hot_share": round(hot / upd, 3) if upd else None,
                        "acks_per_s": round(per * rounds / elapsed),
                    }
            finally:
                with psycopg.connect(db, autocommit=True) as c:
                    c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    return out


def bench_churn(db: str, n: int, passes: int = 100, per: int = 10_000, pause: float = 0.6) -> dict:
    """Sustained acking with autovacuum on (the migration's settings): `passes` acks of `per`
    random ids, `pause` seconds apart, at fillfactor 100 and 70; the table's size as it settles."""
    out = {}
    for ff in (100, 70):
        name = f"bench_churn{ff}_{uuid.uuid4().hex[:8]}"
        schema_mod.migrate(db, name)
        try:
            with psycopg.connect(db) as conn:
                conn.execute(f'ALTER TABLE "{name}".batch_group SET (fillfactor = {ff})')
                batch = tracker.open_batch(conn, schema=name)
                handles = tracker.add_items(conn, batch, n, schema=name)
                conn.commit()
                ids = [i for h in handles for i in h.item_ids]
                random.Random(ff).shuffle(ids)
                sizes = []
                for k in range(passes):
                    tracker.ack(conn, ids[(k * per) % n : (k * per) % n + per], schema=name)
                    conn.commit()
                    time.sleep(pause)
                    if k % 10 == 9:
                        sizes.append(storage_bits(conn, name, n)["bits_per_item"])
                        conn.commit()
                vacuums = conn.execute(
                    "SELECT autovacuum_count FROM pg_stat_user_tables WHERE schemaname = %s "
                    "AND relname = 'batch_group'",
                    [name],
                ).fetchone()[0]
                out[f"ff{ff}"] = {"bits_per_item_every_10_passes": sizes, "autovacuums": vacuums}
        finally:
            with psycopg.connect(db, autocommit=True) as c:
                c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    return out


def bench_storage(conn: psycopg.Connection, schema: str, n: int) -> dict:
    """Bits per tracked item with the enqueued batch alone (n items), then with 9 more batches of
    n items: the btree's fixed pages (metapage + root) weigh on small tables, so also the
    marginal cost per added item."""
    one = storage_bits(conn, schema, n)
    for _ in range(9):
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, n, schema=schema)
        conn.commit()
    ten = storage_bits(conn, schema, 10 * n)
    marginal = (
        ((ten["group_heap_bytes"] + ten["group_index_bytes"]) - (one["group_heap_bytes"] + one["group_index_bytes"]))
        * 8
        / (9 * n)
    )
    return {
        "bits_per_item_one_batch": one["bits_per_item"],
        "bits_per_item_one_batch_with_batch_table": one["bits_per_item_with_batch_table"],
        "bits_per_item_ten_batches": ten["bits_per_item"],
        "bits_per_item_marginal": round(marginal, 4),
        "storage_items_one_batch": n,
        "storage_items_ten_batches": 10 * n,
    }


OUTCOME_TABLES = ("batch", "batch_group", "group_failure")


def _all_set(size: int) -> str:
    """The hex of a mask with the bits of indexes 0..size-1 set."""
    return "ff" * (size >> 3) + (f"{(0xFF00 >> (size & 7)) & 0xFF:02x}" if size & 7 else "")


def _outcome_sizes(conn: psycopg.Connection, schema: str, items: int, live_only: bool) -> dict[str, float]:
    """Total bytes (heap, TOAST, indexes) of the outcome tables per item. live_only: of copies of
    their live rows (same columns, storage, indexes and fillfactor), i.e. what a VACUUM FULL with
    no older snapshot anywhere on the server leaves: on a shared server another session's snapshot
    keeps dead versions that neither VACUUM nor VACUUM FULL may drop."""
    sizes = []
    for t in (*OUTCOME_TABLES, "failure_reason"):
        name = f'"{schema}".{t}'
        if live_only:
            (opts,) = conn.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass", [name]).fetchone()
            with_opts = f" WITH ({', '.join(opts)})" if opts else ""
            conn.execute(f'CREATE TABLE "{schema}".rest_{t} (LIKE {name} INCLUDING ALL){with_opts}')
            conn.execute(f'INSERT INTO "{schema}".rest_{t} SELECT * FROM {name}')
            name = f'"{schema}".rest_{t}'
        sizes.append(conn.execute(f"SELECT pg_total_relation_size('{name}')").fetchone()[0])
        if live_only:
            conn.execute(f"DROP TABLE {name}")
    return {
        "bits_per_item": round(sum(sizes[:3]) * 8 / items, 4),
        "reasons_bits_per_item": round(sizes[3] * 8 / items, 4),
        **{f"{t}_bytes": v for t, v in zip((*OUTCOME_TABLES, "failure_reason"), sizes)},
    }


def bench_outcomes_storage(db: str, items: int, per_batch: int = 1_000_000, fraction: float = 0.01) -> dict:
    """Bits per item at rest with outcomes: `items` in batches of `per_batch`, `fraction` of them
    failed (every 1/fraction-th item, at a varying offset) with no, one shared, or distinct reasons;
    the rest acked; every batch complete."""
    out: dict = {"outcomes_items": items, "outcomes_failed_fraction": fraction}
    step = round(1 / fraction)
    for variant in ("none_failed", "shared_reason", "distinct_reasons"):
        name = f"bench_out_{uuid.uuid4().hex[:8]}"
        schema_mod.migrate(db, name)
        t0 = time.perf_counter()
        try:
            with psycopg.connect(db, autocommit=True) as c:
                c.execute(f'SET search_path TO "{name}"')
                failed = 0
                for start in range(0, items, per_batch):
                    n = min(per_batch, items - start)
                    (b,) = c.execute("SELECT open_batch()").fetchone()
                    c.execute("SELECT * FROM add_items(%s, %s)", [b, n])
                    groups = (n + 8191) // 8192
                    picks = [k * step + (k * 37) % step for k in range(n // step)] if variant != "none_failed" else []
                    failed += len(picks)
                    if variant == "shared_reason":
                        masks = [bytearray(1024) for _ in range(groups)]
                        for i in picks:
                            masks[i >> 13][(i & 8191) >> 3] |= 128 >> (i & 7)
                        c.execute(
                            "SELECT * FROM fail_masks(%s, %s, %s, 'HTTP 503 from the price service')",
                            [[b] * groups, list(range(groups)), [m.hex() for m in masks]],
                        )
                    elif variant == "distinct_reasons":  # one call per item: server-side, committing as it goes
                        c.execute("CREATE TEMP TABLE IF NOT EXISTS bench_fail (k int, g bigint, hex text, reason text)")
                        c.execute("TRUNCATE bench_fail")
                        with c.cursor().copy("COPY bench_fail FROM STDIN") as cp:
                            for k, i in enumerate(picks):
                                j = i & 8191
                                hexed = "00" * (j >> 3) + f"{128 >> (j & 7):02x}"
                                cp.write_row(
                                    (k, i >> 13, hexed, f"HTTP 503 from the price service, request {start + i}")
                                )
                        c.execute(
                            "DO $$ DECLARE r record; n int := 0; BEGIN "
                            f"FOR r IN SELECT * FROM bench_fail ORDER BY k LOOP "
                            f"PERFORM fail_masks(ARRAY[{b}::int8], ARRAY[r.g], ARRAY[r.hex], r.reason); "
                            "n := n + 1; IF n % 500 = 0 THEN COMMIT; END IF; END LOOP; END $$"
                        )
                    c.execute(
                        "SELECT * FROM ack_masks(%s, %s, %s)",
                        [[b] * groups, list(range(groups)), [_all_set(min(8192, n - g * 8192)) for g in range(groups)]],
                    )
                    assert c.execute("SELECT close_batch(%s)", [b]).fetchone() == (True,)
                (got,) = c.execute("SELECT sum(failed) FROM batch WHERE state = 'complete'").fetchone()
                assert got == failed, (got, failed)
                c.execute("VACUUM (ANALYZE) batch, batch_group, group_failure, failure_reason")
                vacuumed = _outcome_sizes(c, name, items, live_only=False)
                live = _outcome_sizes(c, name, items, live_only=True)
            out[variant] = {
                "failed_items": failed,
                "bits_per_item": live["bits_per_item"],
                "reasons_bits_per_item": live["reasons_bits_per_item"],
                "bits_per_item_vacuumed": vacuumed["bits_per_item"],
                "reasons_bits_per_item_vacuumed": vacuumed["reasons_bits_per_item"],
                "bytes": {k: v for k, v in live.items() if k.endswith("_bytes")},
                "build_s": round(time.perf_counter() - t0, 1),
            }
            log(json.dumps({variant: out[variant]}))
        finally:
            with psycopg.connect(db, autocommit=True) as c:
                c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    out["bits_per_item_with_outcomes"] = out["shared_reason"]["bits_per_item"]
    return out
