"""Harvest throughput through PgBouncer (transaction pooling) beside direct, in one run:
`python -m bench.pgbouncer [--quick]`. The last line of output is one JSON object.

Each round pre-fills a fresh outbox (directly) and harvests it with an in-process harvester whose
DSN is either Postgres or PgBouncer (PGBOUNCER_DSN, else the local one on 56432); rounds alternate
so that the shared machine's noise falls on both. Compare the ratio, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from harvester import logs
from harvester.run import tune_process

from .harvest import DSN, Env, harvest_all, prefill, say

PGBOUNCER_DSN = os.environ.get("PGBOUNCER_DSN", "postgresql://postgres@127.0.0.1:56432/outbox")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="50,000 rows a round, 2 rounds each")
    args = ap.parse_args(argv)
    logs.configure("json", "warning")
    tune_process()
    n, rounds = (50_000, 2) if args.quick else (200_000, 3)
    rates: dict[str, list[float]] = {"direct": [], "pgbouncer": []}
    for r in range(rounds):
        for name, dsn in (("direct", DSN), ("pgbouncer", PGBOUNCER_DSN)):
            env = Env()
            try:
                prefill(env, n, keys=1000)
                rate = n / harvest_all(env, n, dsn=dsn)["seconds"]
            finally:
                env.drop()
            rates[name].append(rate)
            say(f"round {r}: {name} {rate:,.0f} records/s")
    direct, pooled = statistics.median(rates["direct"]), statistics.median(rates["pgbouncer"])
    print(
        json.dumps(
            {
                "benchmark": "pgbouncer",
                "records_per_round": n,
                "rounds": rounds,
                "direct_records_per_s": round(direct),
                "pgbouncer_records_per_s": round(pooled),
                "ratio_pgbouncer_to_direct": round(pooled / direct, 3),
                "all": {k: [round(v) for v in vs] for k, vs in rates.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
