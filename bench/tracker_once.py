"""One measurement of the tracker's fan-out and ack rates, by whichever tracker code is on the path.

Run as a script by `python -m bench.tracker --baseline REF`, once with the working tree's code and
once with REF's, each in its own process (bench.baseline.compare):

    PYTHONPATH=TREE python -P bench/tracker_once.py --dsn DSN --items N

It migrates a fresh schema with TREE's own migrations, then times, through the public API only:
- enqueue: `open_batch`, `outbox.enqueue` of N items (~60-byte values) and the commit, in items/s
  (the fan-out: N outbox rows with their headers, the groups and their bits);
- ack: the batch closed, its N item ids shuffled and acked by `tracker.ack` in calls of 50,000, each
  committed (what an acker applying a poll does), in acks/s; the batch must end complete.
The last line of output is one JSON object: items, enqueue_items_per_s, ack_acks_per_s, seconds of
each, and `code`, the folder the tracker was imported from.

Like bench/harvest_once.py, whose `only_tree_on_path` it uses (loaded from its file), it imports
nothing through the `bench` package: under REF's path that would be REF's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
import uuid
from pathlib import Path

import psycopg

ACK_CALL = 50_000  # ids per ack call


def _harvest_once():
    spec = importlib.util.spec_from_file_location("_harvest_once", Path(__file__).with_name("harvest_once.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(dsn: str, items: int, seed: int = 7) -> dict:
    _harvest_once().only_tree_on_path()
    import tracker
    from tracker import outbox
    from tracker import schema as schema_mod

    values = [b'{"sku":"SKU-%08d","op":"reprice","price_cents":%d}' % (i, i % 9973) for i in range(items)]
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    try:
        schema_mod.migrate(dsn, schema)  # this tree's own migrations
        with psycopg.connect(dsn) as conn:
            started = time.perf_counter()
            batch = tracker.open_batch(conn, schema=schema)
            handles = outbox.enqueue(conn, batch, values, topic="bench", schema=schema)
            conn.commit()
            enqueue_s = time.perf_counter() - started
            tracker.close_batch(conn, batch, schema=schema)
            conn.commit()
            ids = [i for h in handles for i in h.item_ids]
            if len(ids) != items:
                raise RuntimeError(f"enqueue returned {len(ids)} item ids for {items} items")
            random.Random(seed).shuffle(ids)  # acks arrive in any order
            started = time.perf_counter()
            for k in range(0, items, ACK_CALL):
                tracker.ack(conn, ids[k : k + ACK_CALL], schema=schema)
                conn.commit()
            ack_s = time.perf_counter() - started
            state = tracker.status(conn, batch, schema=schema).state
            if state != "complete":
                raise RuntimeError(f"the batch is {state!r} after every item was acked")
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return {
        "items": items,
        "enqueue_items_per_s": round(items / enqueue_s),
        "ack_acks_per_s": round(items / ack_s),
        "enqueue_s": round(enqueue_s, 3),
        "ack_s": round(ack_s, 3),
        "code": str(Path(tracker.__file__).resolve().parents[1]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--items", type=int, required=True)
    args = ap.parse_args(argv)
    if args.items < 1:
        ap.error("--items must be at least 1")
    print(json.dumps(measure(args.dsn, args.items)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
