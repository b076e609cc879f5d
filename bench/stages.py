"""Where a harvested record's CPU goes, stage by stage: `python -m bench.stages [--rows N]`.

On the same pre-filled outbox as the harvester's benchmark (bench/harvest_once.py's `prefill`, a
fresh schema and topic), each stage of a harvest is run on its own, with the harvester's own code
where there is one, and its CPU per row read from the process (or the thread, or the database
backend) that does it:

  postgres_mark_purge   the database backend's CPU for the harvester's mark (OutboxStore.mark,
                        5,000 rows, every column and the message id returned) and the purge of
                        those rows (OutboxStore.purge), one after the other until the outbox is
                        empty, as a leader does. One connection: its backend alone is measured,
                        not the WAL writer, the checkpointer or vacuum, and not other sessions.
  postgres_select       before that, the backend's CPU for a plain SELECT, by id range, of what a
                        mark returns (the same columns and message id): an upper bound of what
                        returning the rows costs the server (the SELECT also walks the index and
                        heap pages, as the mark does anyway)
  reaper_mark           the marking thread's CPU in OutboxStore.mark: sending the statements,
                        reading the result, building every row's Python values, sorting
  reaper_purge          the same thread's CPU in OutboxStore.purge (the id runs, one round trip)
  produce_call          on the rows of the last eight marks: the producing thread's CPU in the
                        harvester's produce loop (positional
                        produce(), each row's headers and its message id; a delivery callback per
                        record), against a connected idempotent producer with the harvester's
                        settings (harvester.publishing.publisher.producer_config)
  produce_call_bare     the same loop and records without headers: `produce_call` minus this is
                        what headers cost in the call
  librdkafka            the producer's own threads (batching, compression, requests, delivery
                        reports, served as the harvester's poll thread does) while it sends those
                        records and until every one is acknowledged: the process's CPU minus the
                        producing thread's

The last line is one JSON object: each stage in µs per row, `reaper_stages_us` (the reaper's
stages summed), and, when `--harvest` is given (the default), the same outbox harvested once by
the whole harvester in the same run (bench/harvest_once.py's figures: the reaper's and the database
server's CPU per record) with `stages_of_harvest`, the summed stages over the harvest's own CPU per
record: near 1, the stages account for the harvest; well below, something unmeasured costs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import uuid
from typing import Any

import psycopg
from confluent_kafka import Producer
from psycopg import sql
from psycopg_pool import ConnectionPool

from bench.harvest_once import _stat, harvest, prefilled
from harvester.publishing.outbox_sql import COLUMNS, FOREVER, OutboxStore
from harvester.publishing.publisher import producer_config
from harvester.run import tune_process
from tracker import message_ids
from tracker import schema as schema_mod
from tracker.message_ids import MESSAGE_ID_HEADER

MARK = 5000  # rows per mark and per purge: the harvester's default mark_batch and purge_batch


def _backend_cpu(pid: int) -> float:
    found = _stat(pid)
    if found is None:
        raise RuntimeError(f"database backend {pid} is not a process of this machine: run next to Postgres")
    return found[2]


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mark_and_purge(dsn: str, schema: str, rows: int) -> tuple[dict[str, float], list[list[tuple]]]:
    """The harvester's mark and purge on one connection until the outbox is empty; the marked rows
    of the last few marks are kept for the produce stages (as a leader holds rows in flight)."""
    kept: list[list[tuple]] = []
    with ConnectionPool(dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True) as pool:
        store = OutboxStore(pool, schema)
        with pool.connection() as conn:
            backend = conn.info.backend_pid
        store.namespace()
        leader = uuid.uuid4()
        marked = 0
        server0, mark_s, purge_s = _backend_cpu(backend), 0.0, 0.0
        while True:
            t = time.thread_time()
            got = store.mark(leader, MARK, until=FOREVER)
            mark_s += time.thread_time() - t
            if not got:
                break
            marked += len(got)
            t = time.thread_time()
            store.purge(leader, [row[0] for row in got])
            purge_s += time.thread_time() - t
            kept = [*kept[-7:], got]
        server = _backend_cpu(backend) - server0
    if marked != rows:
        raise RuntimeError(f"marked {marked} of {rows} rows")
    return {
        "postgres_mark_purge": server * 1e6 / rows,
        "reaper_mark": mark_s * 1e6 / rows,
        "reaper_purge": purge_s * 1e6 / rows,
    }, kept


def select_marked_columns(dsn: str, schema: str, rows: int) -> float:
    """The server's CPU per row for reading back what a mark returns, by id range."""
    table = sql.Identifier(schema, "outbox")
    with psycopg.connect(dsn, autocommit=True) as conn:
        ids = message_ids.namespace(conn, schema)
        params = message_ids.message_id_params(ids)
        low = conn.execute(sql.SQL("SELECT min(id) FROM {t}").format(t=table)).fetchone()[0]
        backend = conn.info.backend_pid
        statement = sql.SQL(
            "SELECT " + COLUMNS + ", " + message_ids.MESSAGE_ID_SQL + " FROM {t} WHERE id >= %(lo)s AND id < %(hi)s"
        ).format(t=table)
        cur = conn.cursor(binary=True)
        message_ids.bind_micros2000(cur.adapters)
        server0 = _backend_cpu(backend)
        for start in range(low, low + rows, MARK):
            cur.execute(statement, {**params, "lo": start, "hi": start + MARK})
            cur.fetchall()
        return (_backend_cpu(backend) - server0) * 1e6 / rows


def produce(bootstrap: str, batches: list[list[tuple]], headers: bool) -> dict[str, float]:
    """The harvester's produce call on `batches` (marked rows), then every acknowledgement."""
    producer = Producer(producer_config(bootstrap, {}, {}))
    topic = batches[0][0][1]
    producer.list_topics(topic, timeout=30)  # connected, metadata known: as a leader's producer is
    failed = [0]

    def report(err, msg) -> None:
        if err is not None:
            failed[0] += 1

    n = sum(map(len, batches))
    process0, thread_s = _process_cpu(), 0.0
    for batch in batches:
        t = time.thread_time()
        call = producer.produce
        for _id, topic, key, value, hkeys, hvals, partition, msg_id in batch:
            call(
                topic,
                value,
                key,
                -1 if partition is None else partition,
                report,
                None,
                0,
                ([*zip(hkeys, hvals), (MESSAGE_ID_HEADER, msg_id)] if hkeys else [(MESSAGE_ID_HEADER, msg_id)])
                if headers
                else None,
            )
        thread_s += time.thread_time() - t
        producer.poll(0)  # reports, as the harvester's poll thread serves them: counted as librdkafka's
    if producer.flush(300) != 0 or failed[0]:
        raise RuntimeError(f"{failed[0]} deliveries failed or records unacknowledged after 300 s")
    process = _process_cpu() - process0
    return {"call": thread_s * 1e6 / n, "librdkafka": (process - thread_s) * 1e6 / n}


def measure(dsn: str, bootstrap: str, rows: int, keys: int = 1000, with_harvest: bool = True) -> dict[str, Any]:
    if rows < MARK:
        raise ValueError(f"rows must be at least {MARK}, got {rows!r}")
    with prefilled(dsn, bootstrap, rows, keys, schema_mod.migrate) as (schema, _topic, _leader_topic):
        server_select = select_marked_columns(dsn, schema, rows)
        stages, batches = mark_and_purge(dsn, schema, rows)
        with_headers = produce(bootstrap, batches, headers=True)
        bare = produce(bootstrap, batches, headers=False)
    out: dict[str, Any] = {
        "records": rows,
        "stages_us": {
            "postgres_mark_purge": stages["postgres_mark_purge"],
            "postgres_select": server_select,
            "reaper_mark": stages["reaper_mark"],
            "reaper_purge": stages["reaper_purge"],
            "produce_call": with_headers["call"],
            "produce_call_bare": bare["call"],
            "librdkafka": with_headers["librdkafka"],
        },
    }
    reaper = stages["reaper_mark"] + stages["reaper_purge"] + with_headers["call"] + with_headers["librdkafka"]
    out["stages_us"] = {k: round(v, 2) for k, v in out["stages_us"].items()}
    out["reaper_stages_us"] = round(reaper, 2)
    if with_harvest:
        # The whole harvester on a fresh outbox of the same rows, in this process (its own schema).
        whole = harvest(dsn, bootstrap, rows, keys, {})
        out["harvest"] = {k: whole[k] for k in ("records_per_s", "cpu_us_per_record", "postgres_cpu_us_per_record")}
        out["stages_of_harvest"] = round(reaper / whole["cpu_us_per_record"], 3) if whole["cpu_us_per_record"] else None
    return out


MAX_ROWS = 10_000_000


def _rows(text: str) -> int:
    try:
        rows = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rows must be a whole number, got {text!r}") from None
    if not MARK <= rows <= MAX_ROWS:
        raise argparse.ArgumentTypeError(f"--rows must be between {MARK:,} and {MAX_ROWS:,}, got {text}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=_rows, default=200_000, help="rows of the pre-filled outbox (default 200,000)")
    ap.add_argument("--no-harvest", action="store_true", help="skip the whole harvest of the same rows")
    ap.add_argument("--dsn", default=os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox"))
    ap.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:59092"))
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]
    tune_process()  # the reaper's collector and switch interval, as the harvester's stages run
    result = measure(args.dsn, args.bootstrap, args.rows, with_harvest=not args.no_harvest)
    result["load_average_at_start"] = load
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
