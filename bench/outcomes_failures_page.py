"""Cost of one page of failures() when the items of one group failed under many distinct reasons,
and the storage they take.

A group's failed items with one reason share one group_failure row: their indexes (2 bytes each)
when few, the group's bitmap when that is smaller. A page reads, per group, only the rows whose
items it may return (by their first item) and from each only the items after its cursor.

    python -m bench.outcomes_failures_page 8192     # needs OUTBOX_TEST_DSN

Measured (8192 items of one group, each failed alone with its own reason; shared CI machine):
group_failure 632 kB (79 bytes per failed item); one page of 1, 100 or 1000 items: 1 to 11 ms.
With one shared reason: one row of 1,088 bytes, pages of 1 to 7 ms. Before, with one bitmap of the
group's size per reason and a page walking every bit of every row: 9.7 MB, 4.5 to 6 s a page.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import psycopg

from tracker import schema as schema_mod


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.outcomes_failures_page",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("items", type=int, nargs="?", default=8192, help="failed items of one group (default 8192)")
    n = parser.parse_args().items
    dsn = os.environ["OUTBOX_TEST_DSN"]
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(dsn, name)
    try:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'SET search_path TO "{name}"')
            for distinct in (False, True):
                (b,) = c.execute("SELECT open_batch()").fetchone()
                c.execute("SELECT * FROM add_items(%s, %s)", [b, n])
                for i in range(n):
                    reason = f"HTTP 503 from upstream, request {i}" if distinct else "HTTP 503 from upstream"
                    c.execute("SELECT * FROM fail(ARRAY[%s], %s)", [f"{b}:0:{i}", reason])
                (rows, size) = c.execute(
                    "SELECT count(*), pg_size_pretty(sum(pg_column_size(f.*))) FROM group_failure f WHERE batch_id = %s",
                    [b],
                ).fetchone()
                for limit in (1, 100, 1000):
                    started = time.monotonic()
                    got = c.execute("SELECT * FROM failures(%s, NULL, %s)", [b, limit]).fetchall()
                    took = time.monotonic() - started
                    print(
                        f"items={n} distinct_reasons={distinct} group_failure_rows={rows} ({size}) "
                        f"limit={limit} rows={len(got)} page_s={took:.3f}"
                    )
    finally:
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


if __name__ == "__main__":
    main()
