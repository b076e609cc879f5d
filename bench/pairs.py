"""Compare two versions of something within one run: measurements alternate in pairs.

On a shared machine whose speed drifts (2x from hour to hour here), a figure from today cannot be
compared with a target from another day. `alternate` measures the new and the old side in pairs,
the order flipping from pair to pair (new old, old new, new old, ...: A B B A A B ...), so a drift
that is slow next to one pair cancels out of each pair's ratio new/old, and reports the ratios'
median, min and max: the spread says how far one run can be trusted.

A side is any callable returning one figure (`Command` runs a program and reads the figure from the
JSON object on its last line of output); bench.harvest compares harvester throughput this way.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Side = Callable[[], float]


def load_average() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded (os.getloadavg)."""
    return [round(x, 2) for x in os.getloadavg()]


def summary(values: Sequence[float]) -> dict[str, float]:
    """median, min, max, and the spread: (max - min) / median."""
    med = statistics.median(values)
    return {
        "median": round(med, 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "spread": round((max(values) - min(values)) / med, 3) if med else 0.0,
    }


def order(pairs: int) -> list[tuple[str, str]]:
    """Which side goes first in each pair: new first in even pairs, old first in odd ones."""
    return [("new", "old") if i % 2 == 0 else ("old", "new") for i in range(pairs)]


def alternate(
    new: Side,
    old: Side,
    pairs: int,
    *,
    after_pair: Callable[[int], Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run `pairs` pairs of one `new()` and one `old()`, alternating which goes first.

    Returns the sequence as run (`order`), each pair's figures and ratio new/old (`pairs`), the
    ratios' summary (`ratio`), each side's (`new`, `old`), and the load average before the first
    measurement. `after_pair(i)`, if given, runs after each pair; what it returns is kept in that
    pair's entry as `after`.
    """
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    sides = {"new": new, "old": old}
    result: dict[str, Any] = {"load_average_at_start": load_average(), "cpus": os.cpu_count(), "order": []}
    rows = []
    for i, (first, second) in enumerate(order(pairs)):
        figures = {}
        for name in (first, second):
            result["order"].append(name)
            figures[name] = float(sides[name]())
            if log is not None:
                log(f"pair {i + 1}/{pairs}: {name} {figures[name]:g}")
        row: dict[str, Any] = {
            "first": first,
            "new": figures["new"],
            "old": figures["old"],
            "ratio": round(figures["new"] / figures["old"], 3),
        }
        if after_pair is not None:
            row["after"] = after_pair(i)
        rows.append(row)
        if log is not None:
            log(f"pair {i + 1}/{pairs}: ratio new/old {row['ratio']}")
    result["pairs"] = rows
    result["ratio"] = summary([r["ratio"] for r in rows])
    result["new"] = summary([r["new"] for r in rows])
    result["old"] = summary([r["old"] for r in rows])
    result["load_average_at_end"] = load_average()
    return result


class CommandFailed(RuntimeError):
    pass


class Command:
    """A side that runs `argv` in its own process and returns `figure` from its last output line
    (a JSON object). Every run's whole object is kept in `runs`; a run whose object does not
    have the values in `expect` fails (bench.harvest checks where the code came from)."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        figure: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 1800.0,
        expect: Mapping[str, Any] | None = None,
    ) -> None:
        self.name, self.argv, self.figure = name, list(argv), figure
        self.expect = dict(expect or {})
        self.env, self.cwd, self.timeout = env, cwd, timeout
        self.runs: list[dict[str, Any]] = []

    def __call__(self) -> float:
        started = time.monotonic()
        with subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as p:
            try:
                stdout, stderr = p.communicate(timeout=self.timeout)
            except BaseException:
                # Interrupted (Ctrl-C reaches the child too) or timed out: give the child time to
                # clean up after itself (drop its schema and topics) before killing it.
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                raise
        lines = stdout.strip().splitlines()
        if p.returncode != 0 or not lines:
            raise CommandFailed(
                f"{self.name}: {' '.join(self.argv)} exited {p.returncode}; its last output:\n"
                f"{stdout[-1500:]}{stderr[-3000:]}"
            )
        try:
            out = json.loads(lines[-1])
            value = float(out[self.figure])
        except (ValueError, KeyError, TypeError) as exc:
            raise CommandFailed(f"{self.name}: no figure {self.figure!r} in its last line {lines[-1][:500]!r}") from exc
        for key, want in self.expect.items():
            if out.get(key) != want:
                raise CommandFailed(f"{self.name}: {key} is {out.get(key)!r}, expected {want!r}")
        out["wall_s"] = round(time.monotonic() - started, 3)
        self.runs.append(out)
        return value


def stderr_log(prefix: str) -> Callable[[str], None]:
    return lambda msg: print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)
