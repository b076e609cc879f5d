"""Every first-use download of the test suite, all at once, before the test workers start.

    python deploy/local/caches.py      # `make caches`; run with the project's virtualenv Python

Kafka's jars, Spark's Kafka connector, the Node, Go and JDBC clients, Debian's prometheus and
Chromium. Each resolver is safe beside the others and beside a second copy of itself (a lock per
download in deploy/local/first_use.py, one apt-get at a time per machine, Go's own caches), so they
run side by side: on a cold machine the downloads wait on the network and the Go build on a core,
and together they take about as long as the slowest of them instead of their sum.

Each step's output is printed whole when it ends, with how long it took; the exit status is 1 if
any step failed (each failed one is named), after every step has ended. Standard library only.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]


@dataclass(frozen=True)
class Done:
    step: Step
    returncode: int
    output: str
    seconds: float


def steps(python: str = sys.executable) -> list[Step]:
    """The downloads `make test` needs, each as the command that resolves it."""
    return [
        Step("kafka jars", (python, "deploy/local/services.py", "fetch")),
        Step("spark kafka connector", (python, "deploy/spark/jars.py")),
        Step("node client", (python, "tests/clients/node/install.py")),
        Step("go client", (python, "tests/clients/go/install.py")),
        Step("jdbc client", (python, "tests/clients/jvm/install.py")),
        Step("prometheus", (python, "deploy/prometheus/local.py", "install")),
        Step("chromium", (python, "deploy/console/browser.py", "install")),
    ]


def _run(step: Step, cwd: Path) -> Done:
    started = time.monotonic()
    try:
        done = subprocess.run(
            step.argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    except OSError as exc:  # the interpreter or the script cannot be started at all
        return Done(step, 127, f"{exc}\n", time.monotonic() - started)
    return Done(step, done.returncode, done.stdout, time.monotonic() - started)


def run_all(todo: Sequence[Step], cwd: Path = REPO, out=sys.stdout) -> list[Done]:
    """Run every step at once; print each one's output when it ends. Returns the failed steps."""
    failed: list[Done] = []
    if not todo:
        return failed
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        for future in as_completed([pool.submit(_run, step, cwd) for step in todo]):
            done = future.result()
            verdict = "done" if done.returncode == 0 else f"FAILED (exit status {done.returncode})"
            if done.output:
                out.write(done.output if done.output.endswith("\n") else done.output + "\n")
            out.write(f"[caches] {done.step.name}: {verdict} in {done.seconds:.1f} s\n")
            out.flush()
            if done.returncode != 0:
                failed.append(done)
    return failed


def main() -> int:
    failed = run_all(steps())
    if failed:
        names = ", ".join(d.step.name for d in failed)
        print(f"[caches] failed: {names} (each one's output is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
