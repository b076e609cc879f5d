"""How long `reaper migrate` (0016_outcomes.sql and the definitions) blocks live acks, and how much
the batch table grows, on a schema of the previous chain holding N complete batches.

Migrates a fresh schema with the sql/ of commit c4a30f3 (the chain before outcomes), inserts N
complete batches and one open batch, then runs the current migrate while a thread acks one item of
the open batch every 10 ms through the SQL function ack(). Prints migrate seconds, the longest ack
during it, any ack error, and the table's size before and after.

    python -m bench.outcomes_upgrade_lock 1000000     # needs OUTBOX_TEST_DSN and the git history

Measured (1,000,000 complete batches, shared CI machine): migrate 0.46 s, longest ack 0.40 s,
batch table 167 MB -> 167 MB. With the backfill `UPDATE batch SET outcome = 'succeeded'` that 0016
had before (a batch finished before it now reads as succeeded with no outcome stored): 7.3 s,
7.2 s, 167 MB -> 372 MB, as it rewrote every complete batch under the ACCESS EXCLUSIVE lock.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg

from tracker import schema as schema_mod

OLD = "c4a30f3"
REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.outcomes_upgrade_lock",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("batches", type=int, nargs="?", default=1_000_000, help="complete batches (default 1,000,000)")
    n = parser.parse_args().batches
    dsn = os.environ["OUTBOX_TEST_DSN"]
    name = f"t_{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD, "sql"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        schema_mod.migrate(dsn, name, Path(tmp) / "sql")
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'SET search_path TO "{name}"')
            c.execute(
                "INSERT INTO batch (state, total, pending, closed_at, completed_at) "
                "SELECT 'complete', 10, 0, now(), now() FROM generate_series(1, %s)",
                [n],
            )
            (live,) = c.execute("SELECT open_batch()").fetchone()
            c.execute("SELECT * FROM add_items(%s, 8000)", [live])
            (before,) = c.execute("SELECT pg_size_pretty(pg_total_relation_size('batch'))").fetchone()
        stop = threading.Event()
        slowest = [0.0]
        errors: list[str] = []

        def acker() -> None:
            with psycopg.connect(dsn, autocommit=True) as a:
                a.execute(f'SET search_path TO "{name}"')
                i = 0
                while not stop.is_set() and i < 8000:
                    started = time.monotonic()
                    try:
                        a.execute("SELECT * FROM ack(ARRAY[%s])", [f"{live}:0:{i}"])
                    except psycopg.Error as exc:
                        errors.append(type(exc).__name__)
                    slowest[0] = max(slowest[0], time.monotonic() - started)
                    i += 1
                    time.sleep(0.01)

        thread = threading.Thread(target=acker)
        thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        schema_mod.migrate(dsn, name)
        took = time.monotonic() - started
        stop.set()
        thread.join()
        with psycopg.connect(dsn, autocommit=True) as c:
            (after,) = c.execute(f"SELECT pg_size_pretty(pg_total_relation_size('\"{name}\".batch'))").fetchone()
        print(
            f"batches={n} migrate_s={took:.2f} slowest_ack_s={slowest[0]:.2f} ack_errors={errors} "
            f"batch_table={before}->{after}"
        )
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


if __name__ == "__main__":
    main()
