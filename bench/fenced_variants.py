"""Fenced publishing variants alternated within one run (order reversed every other round), at
2,000 rec/s, each SECONDS long (bench/harvest_latency.py), the machine's Kafka floor among them:

    python -m bench.fenced_variants SECONDS ROUNDS NAME...

NAME: unfenced, fenced, fenced_idle1ms (harvester.idle_poll_interval 1 ms), fenced_3prod (three
producers in turn), fenced_nagle (Nagle's algorithm on), fenced_switch5ms / fenced_switch0.1ms (the
process's thread switch interval instead of `reaper run`'s 0.5 ms), bare_idem, bare_txn2, and
bare_owned2 / bare_owned4 (2 or 4 transactional producers each owning a share of the partitions,
their transactions overlapping: a design the harvester does not use; bench/fenced_floor.py).
The last line is JSON: every run, and each variant's p99 over the first variant's, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from collections.abc import Callable

from bench.fenced_floor import bare, owned
from bench.harvest import BOOTSTRAP, PARTITIONS, Env
from bench.harvest_latency import bench_latency
from harvester import logs
from harvester.publishing import publisher
from harvester.run import tune_process

RATE = 2000.0


def _tid() -> dict:
    return {"transactional_id": f"bench-{uuid.uuid4().hex[:8]}"}


def _three_producers(seconds: float) -> dict:
    saved, publisher.TXN_PRODUCERS = publisher.TXN_PRODUCERS, 3
    try:
        return bench_latency(seconds, RATE, **_tid())
    finally:
        publisher.TXN_PRODUCERS = saved


def _switch(seconds: float, interval: float) -> dict:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        return bench_latency(seconds, RATE, **_tid())
    finally:
        sys.setswitchinterval(saved)


def _bare(seconds: float, producers: int) -> dict:
    env = Env()
    try:
        return bare(BOOTSTRAP, env.topic, seconds, RATE, producers=producers)
    finally:
        env.drop()


def _owned(seconds: float, owners: int) -> dict:
    env = Env()
    try:
        return owned(BOOTSTRAP, env.topic, PARTITIONS, seconds, RATE, owners=owners)
    finally:
        env.drop()


VARIANTS: dict[str, Callable[[float], dict]] = {
    "unfenced": lambda s: bench_latency(s, RATE),
    "fenced": lambda s: bench_latency(s, RATE, **_tid()),
    "fenced_idle1ms": lambda s: bench_latency(s, RATE, idle_poll_interval=0.001, **_tid()),
    "fenced_3prod": _three_producers,
    "fenced_nagle": lambda s: bench_latency(s, RATE, kafka_producer={"socket.nagle.disable": False}, **_tid()),
    "fenced_switch5ms": lambda s: _switch(s, 0.005),
    "fenced_switch0.1ms": lambda s: _switch(s, 0.0001),
    "bare_idem": lambda s: _bare(s, 0),
    "bare_txn2": lambda s: _bare(s, 2),
    "bare_owned2": lambda s: _owned(s, 2),
    "bare_owned4": lambda s: _owned(s, 4),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fenced_variants",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("seconds", type=float, help="seconds each variant runs per round")
    parser.add_argument("rounds", type=int, help="rounds; the order of the variants alternates")
    parser.add_argument("variants", nargs="*", help=f"the first is the reference; known: {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    seconds, rounds, names = args.seconds, args.rounds, args.variants
    logs.configure("json", "warning")
    tune_process()
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        print(f"unknown variants {unknown}; known: {sorted(VARIANTS)}", file=sys.stderr)
        return 2
    out: dict[str, list[dict]] = {n: [] for n in names}
    loads = []
    for r in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for n in names if r % 2 == 0 else names[::-1]:
            res = VARIANTS[n](seconds)
            out[n].append(res)
            print(f"[fenced_variants] {n} p50 {res['p50_ms']} ms p99 {res['p99_ms']} ms", file=sys.stderr, flush=True)
    ref = names[0]
    ratios = {n: [round(a["p99_ms"] / b["p99_ms"], 2) for a, b in zip(out[n], out[ref])] for n in names[1:]}
    print(json.dumps({"runs": out, f"p99_over_{ref}": ratios, "load1_at_round_start": loads}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
