"""`python -m bench.tracker --baseline REF [--pairs N] [--items N]`: REF's tracker against the working tree's.

Each pair runs bench/tracker_once.py once under each side's code (bench.baseline.compare: fresh
schema migrated by that side, alternating which side goes first), and compares two figures:
`enqueue_items_per_s` (the fan-out) and `ack_acks_per_s` (bulk acks). For each: the ratio new/old
pair by pair and its median, min, max and spread, beside both sides' own summaries; the load
averages at the start and the end. Compare ratios, not absolutes: the machine is shared.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from bench import baseline

FIGURES = ("enqueue_items_per_s", "ack_acks_per_s")  # the first one is what bench.pairs alternates on


def bench_baseline(
    ref: str, pairs: int, items: int, dsn: str, log: Callable[[str], None], python: str = sys.executable
) -> dict[str, Any]:
    script = baseline.REPO / "bench" / "tracker_once.py"
    args = ["--dsn", dsn, "--items", str(items)]
    log(f"{pairs} pairs of {items} items")
    cmp = baseline.compare(ref, script, args, FIGURES[0], pairs, log=log, python=python, more=FIGURES[1:])
    return {**cmp, "items": items}
