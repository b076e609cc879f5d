"""Cost of building completion events with the schema's completion_event (called through a LATERAL
join; the planner inlines it) against the statements of commit c4a30f3, which built them inline.

Runs the same bulk ack (`Tracker.ack(..., claims=False)`: masked updates of 1000 batches in one
statement) in both trees, each against a schema its own migrate made: once completing none of the
batches (the acker's usual call), once completing all of them. Prints one JSON line per tree with
median milliseconds per call, and the ratios new/old, measured in the same run.

    python -m bench.completion_event_cost [--reps N]   # needs OUTBOX_TEST_DSN and the git history
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

OLD = "c4a30f3"
REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import os, sys, time, uuid, statistics, json
sys.path.insert(0, sys.argv[1])
import psycopg
from psycopg import sql
import tracker
from tracker import schema as S
dsn = os.environ["OUTBOX_TEST_DSN"]
name = "bench_ev_" + uuid.uuid4().hex[:8]
S.migrate(dsn, name)
t = tracker.Tracker(schema=name)
res = {"none_completing_ms": [], "all_completing_ms": []}
try:
    with psycopg.connect(dsn) as c:
        for rep in range(int(sys.argv[2])):
            for kind in res:
                ids = []
                for _ in range(1000):
                    b = t.open_batch(c)
                    [g] = t.add_items(c, b, 2)
                    t.close_batch(c, b)
                    ids += g.item_ids if kind == "all_completing_ms" else g.item_ids[:1]
                c.commit()
                t0 = time.perf_counter()
                t.ack(c, ids, claims=False)
                c.commit()
                res[kind].append((time.perf_counter() - t0) * 1e3)
finally:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))
print(json.dumps({k: round(statistics.median(v[1:]), 1) for k, v in res.items()}))
"""


def run(tree: Path, reps: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), str(reps)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.completion_event_cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--reps", type=int, default=int(os.environ.get("REPS", "6")), help="calls per tree (default 6)")
    reps = parser.parse_args().reps
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", OLD], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        old, new = run(Path(tmp), reps), run(REPO, reps)
    print(json.dumps({"tree": OLD, **old}))
    print(json.dumps({"tree": "HEAD", **new}))
    print(json.dumps({"ratio_new_over_old": {k: round(new[k] / old[k], 2) for k in old}}))


if __name__ == "__main__":
    main()
