"""The inbox's figures, for `python -m bench.consumers` (or alone: `python -m bench.inbox`).

  consume       W worker processes (W = 1 and 16), each with its own connection and its own message
                ids (one in ten delivered twice), for a fixed time: per message a transaction that
                writes the effect row and commits (plain), or runs the effect through
                `tracker.inbox.run_once` and commits (inbox). messages/s each, and inbox/plain; then
                inbox x1 again with about 100 more (empty, hourly) partitions, each claim probing all.
  cleanup       P expired partitions of N ids each dropped by `tracker.inbox.retention.maintain`
                (detach concurrently, drop), against a DELETE of the same ids from one unpartitioned
                table with the same index plus one on the receive time, and the VACUUM it needs
                after (the naive cleanup): seconds and WAL per id each, and (delete+vacuum)/drop.
  storage       bytes at rest per id (36-character ids, after VACUUM): pg_total_relation_size of a
                partition / its ids.

Against the local Postgres (OUTBOX_TEST_DSN). The machine is shared: compare ratios measured in the
same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import sys
import time
import uuid

import psycopg
from psycopg import sql

from tracker import schema as schema_mod
from tracker.inbox import Inbox, retention

DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
CTX = mp.get_context("spawn")


def say(msg: str) -> None:
    print(f"[bench.inbox] {msg}", file=sys.stderr, flush=True)


def worker(schema: str, mode: str, w: int, seconds: float, tag: str, barrier, out) -> None:
    box = Inbox("bench", schema=schema, registry=None)
    insert = sql.SQL("INSERT INTO {} (message_id) VALUES (%s)").format(sql.Identifier(schema, "bench_effect"))
    n = dups = 0
    with psycopg.connect(DSN) as conn:
        barrier.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            mid = f"{tag}-{w}-{n - 1 if n % 10 == 9 else n}"  # one in ten: the previous id again
            if mode == "plain":
                conn.execute(insert, [mid])
            elif not box.run_once(conn, mid, lambda c, m=mid: c.execute(insert, [m])).first_time:
                dups += 1
            conn.commit()
            n += 1
    out.put((n, dups))


def consume(schema: str, mode: str, workers: int, seconds: float, tag: str) -> dict:
    barrier, out = CTX.Barrier(workers + 1), CTX.Queue()
    procs = [
        CTX.Process(target=worker, args=(schema, mode, w, seconds, tag, barrier, out), daemon=True)
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    barrier.wait(120)
    started = time.monotonic()
    results = [out.get(timeout=300) for _ in procs]
    elapsed = time.monotonic() - started
    for p in procs:
        p.join(30)
    n = sum(r[0] for r in results)
    return {"workers": workers, "messages": n, "duplicates": sum(r[1] for r in results), "per_s": round(n / elapsed)}


def _wal(c: psycopg.Connection) -> str:
    return c.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]


def _wal_bytes(c: psycopg.Connection, since: str) -> int:
    return int(c.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [since]).fetchone()[0])


def cleanup(schema: str, partitions: int, ids: int) -> dict:
    base = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)
    s = sql.Identifier(schema)
    with psycopg.connect(DSN, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(s))
        c.execute("CREATE TABLE naive (LIKE inbox INCLUDING DEFAULTS)")
        c.execute("CREATE UNIQUE INDEX ON naive (consumer, message_id)")
        c.execute("CREATE INDEX ON naive (received_at)")
        for i in range(partitions):
            name, lo = f"inbox_old_{i}", base + datetime.timedelta(days=i)
            c.execute(sql.SQL("CREATE TABLE {} (LIKE inbox INCLUDING DEFAULTS)").format(sql.Identifier(name)))
            c.execute(sql.SQL("CREATE UNIQUE INDEX ON {} (consumer, message_id)").format(sql.Identifier(name)))
            c.execute(
                sql.SQL("ALTER TABLE inbox ATTACH PARTITION {} FOR VALUES FROM ({}) TO ({})").format(
                    sql.Identifier(name), sql.Literal(lo), sql.Literal(lo + datetime.timedelta(days=1))
                )
            )
            c.execute("INSERT INTO inbox_partition VALUES (%s, %s, %s)", [name, lo, lo + datetime.timedelta(days=1)])
            fill = "SELECT 'bench', md5(%s || g::text), %s FROM generate_series(1, %s) g"
            c.execute(sql.SQL("INSERT INTO {} " + fill).format(sql.Identifier(name)), [name, lo, ids])
            c.execute("INSERT INTO naive " + fill, [name, lo, ids])
        c.execute("VACUUM ANALYZE naive")
        c.execute("VACUUM ANALYZE inbox")
        c.execute("CHECKPOINT")
        lsn, started = _wal(c), time.perf_counter()
        c.execute("DELETE FROM naive WHERE received_at < %s", [base + datetime.timedelta(days=partitions)])
        delete_s, delete_wal = time.perf_counter() - started, _wal_bytes(c, lsn)
        started = time.perf_counter()
        c.execute("VACUUM naive")  # what the DELETE left behind: dead tuples and index entries
        vacuum_s, delete_wal = time.perf_counter() - started, _wal_bytes(c, lsn)
        c.execute("CHECKPOINT")
        lsn, started = _wal(c), time.perf_counter()
        got = retention.maintain(
            c, schema=schema, policy=retention.Retention(retention=86400, max_drops=partitions, ahead=0)
        )
        drop_s, drop_wal = time.perf_counter() - started, _wal_bytes(c, lsn)
    assert len(got.dropped) == partitions, got
    total = partitions * ids
    return {
        "partitions": partitions,
        "ids": total,
        "drop_seconds": round(drop_s, 4),
        "drop_ms_per_partition": round(drop_s * 1000 / partitions, 2),
        "drop_us_per_id": round(drop_s * 1e6 / total, 3),
        "drop_wal_bytes_per_id": round(drop_wal / total, 2),
        "delete_seconds": round(delete_s, 4),
        "delete_us_per_id": round(delete_s * 1e6 / total, 3),
        "vacuum_after_delete_seconds": round(vacuum_s, 4),
        "delete_wal_bytes_per_id": round(delete_wal / total, 2),
    }


def storage(schema: str, ids: int) -> dict:
    with psycopg.connect(DSN, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        c.execute("CREATE TABLE sized (LIKE inbox INCLUDING DEFAULTS)")
        c.execute("CREATE UNIQUE INDEX ON sized (consumer, message_id)")
        c.execute(
            "INSERT INTO sized SELECT 'billing', gen_random_uuid()::text, now() FROM generate_series(1, %s)", [ids]
        )
        c.execute("VACUUM ANALYZE sized")
        heap, total = c.execute("SELECT pg_table_size('sized'), pg_total_relation_size('sized')").fetchone()
    return {"ids": ids, "bytes_per_id": round(total / ids, 1), "heap_bytes_per_id": round(heap / ids, 1)}


def figures(quick: bool) -> dict:
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    schema_mod.migrate(DSN, schema)
    seconds = 1.5 if quick else 3.0
    try:
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(
                sql.SQL("CREATE TABLE {} (message_id text NOT NULL)").format(sql.Identifier(schema, "bench_effect"))
            )
        runs = {}
        for w in (1, 16):
            for mode in ("plain", "inbox"):
                runs[f"{mode}_{w}"] = consume(schema, mode, w, seconds, f"{mode}{w}")
                say(f"{mode} x{w}: {runs[f'{mode}_{w}']}")
        with psycopg.connect(DSN, autocommit=True) as c:  # ~100 more partitions: each claim probes them all
            more = retention.maintain(
                c, schema=schema, policy=retention.Retention(bucket=3600, ahead=4 * 86400 + 100 * 3600)
            )
            parts = len(retention.partitions(c, schema=schema))
        runs["inbox_1_many_partitions"] = consume(schema, "inbox", 1, seconds, "many")
        runs["inbox_1_many_partitions"]["partitions"] = parts
        say(f"inbox x1 with {parts} partitions ({len(more.created)} made): {runs['inbox_1_many_partitions']}")
        clean = cleanup(schema, 4, 25_000 if quick else 100_000)
        say(f"cleanup: {clean}")
        size = storage(schema, 50_000 if quick else 200_000)
        say(f"storage: {size}")
    finally:
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    return {
        "messages_per_s": {k: v["per_s"] for k, v in runs.items()},
        "ratio_inbox_vs_plain_1": round(runs["inbox_1"]["per_s"] / runs["plain_1"]["per_s"], 3),
        "ratio_inbox_vs_plain_16": round(runs["inbox_16"]["per_s"] / runs["plain_16"]["per_s"], 3),
        "ratio_inbox_many_vs_few_partitions_1": round(
            runs["inbox_1_many_partitions"]["per_s"] / runs["inbox_1"]["per_s"], 3
        ),
        "cleanup": clean,
        "ratio_cleanup_delete_vs_drop_time": round(
            (clean["delete_seconds"] + clean["vacuum_after_delete_seconds"]) / max(clean["drop_seconds"], 1e-9), 1
        ),
        "ratio_cleanup_delete_vs_drop_wal": round(
            clean["delete_wal_bytes_per_id"] / max(clean["drop_wal_bytes_per_id"], 1e-9), 1
        ),
        "storage_bytes_per_id": size["bytes_per_id"],
        "detail": {"consume": runs, "storage": size},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.inbox", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer messages and partitions (seconds, not minutes)")
    quick = parser.parse_args(argv).quick
    out = {"bench": "inbox", "quick": quick, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    out.update(figures(quick))
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
