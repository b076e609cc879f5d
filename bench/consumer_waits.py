"""Where exactly_once consumers of one batch wait: `python -m bench.consumer_waits [workers]`.
Last line: one JSON object.

One closed batch of 400 items; `workers` threads (default 16, one process, so the Python side
costs little CPU) each take ids from a queue, run exactly_once with a 20 ms effect and commit;
a monitor samples pg_stat_activity every 20 ms. Measured for the locking path used before ack claims
(apply_masks in the caller's transaction, then the effect) and for tracker.exactly_once (claims),
one after the other in the same run, with a harvester.services.claim_settler.ClaimSettler running as in `reaper run`.
Reports items/s and the share of the workers' samples spent in Lock waits.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import sys
import threading
import time
import uuid

import psycopg

import tracker
from harvester.services.claim_settler import ClaimSettler
from tracker import schema as schema_mod

DSN = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")


def measure(path: str, workers: int, schema: str) -> dict:
    app = f"bench-waits-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(DSN) as c:
        b = tracker.open_batch(c, schema=schema)
        ids = [i for h in tracker.add_items(c, b, 400, schema=schema) for i in h.item_ids]
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    jobs: queue.Queue = queue.Queue()
    for i in ids:
        jobs.put(i)

    def work() -> None:
        with psycopg.connect(DSN, application_name=app) as c:
            while True:
                try:
                    item = jobs.get_nowait()
                except queue.Empty:
                    return
                if path == "direct":
                    with c.transaction():  # a savepoint: the locking ack, then the effect
                        if tracker.apply_masks(c, tracker.fold([item]), schema=schema).acked:
                            time.sleep(0.02)
                else:
                    tracker.exactly_once(c, item, lambda _s: time.sleep(0.02), schema=schema)
                c.commit()

    threads = [threading.Thread(target=work) for _ in range(workers)]
    started = time.monotonic()
    for t in threads:
        t.start()
    waits: collections.Counter = collections.Counter()
    with psycopg.connect(DSN, autocommit=True) as m:
        while any(t.is_alive() for t in threads):
            for (event,) in m.execute(
                "SELECT coalesce(wait_event_type, 'cpu') FROM pg_stat_activity WHERE application_name = %s", [app]
            ).fetchall():
                waits[event] += 1
            time.sleep(0.02)
    elapsed = time.monotonic() - started
    total = sum(waits.values()) or 1
    return {
        "workers": workers,
        "items_per_s": round(400 / elapsed, 1),
        "lock_wait_share": round(waits["Lock"] / total, 3),
        "samples": dict(waits),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.consumer_waits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("workers", type=int, nargs="?", default=16, help="concurrent consumers (default 16)")
    workers = parser.parse_args(argv).workers
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    schema_mod.migrate(DSN, schema)
    stop = threading.Event()
    threading.Thread(target=ClaimSettler(dsn=DSN, schema=schema).run, args=(stop,), daemon=True).start()
    try:
        out = {"bench": "consumer_waits", "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
        for path in ("direct", "library"):
            out[path] = {"1": measure(path, 1, schema), str(workers): measure(path, workers, schema)}
            print(f"[bench.consumer_waits] {path}: {out[path]}", file=sys.stderr, flush=True)
        d, lib = out["direct"], out["library"]
        w = str(workers)
        out["library_vs_direct_at_workers"] = round(lib[w]["items_per_s"] / d[w]["items_per_s"], 2)
        out["library_workers_vs_1"] = round(lib[w]["items_per_s"] / lib["1"]["items_per_s"], 2)
        out["direct_workers_vs_1"] = round(d[w]["items_per_s"] / d["1"]["items_per_s"], 2)
        out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        stop.set()
        time.sleep(0.05)
        with psycopg.connect(DSN, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
