"""Every first-use download of the test suite, all at once, before the test workers start.

    python deploy/local/caches.py      # `make caches`; run with the project's virtualenv Python

Kafka's jars, Spark's Kafka connector, the Node, Go and JDBC clients, Debian's prometheus and
Chromium. Each resolver is safe beside the others and beside a second copy of itself (a lock per
download in deploy/local/first_use.py, one apt-get at a time per machine, Go's own caches), so they
run side by side: on a cold machine the downloads wait on the network and the Go build on a core,
and together they take about as long as the slowest of them instead of their sum.

Each step's output is printed whole when it ends, with how long it took; the exit status is 1 if
any step failed (each failed one is named), after every step has ended. A SIGTERM (make's, a CI
job's cancel) is passed on to every step still running, so none is left behind holding a lock; a
Ctrl-C reaches them all through the terminal. Standard library only.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
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


class Running:
    """The steps' processes still running, so a SIGTERM can be passed on to each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[subprocess.Popen[str]] = set()
        self._terminated = False

    def start(self, step: Step, cwd: Path) -> subprocess.Popen[str] | None:
        """The step's process, or None when a SIGTERM came first (nothing more is started)."""
        with self._lock:
            if self._terminated:
                return None
            proc = subprocess.Popen(
                step.argv,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            self._live.add(proc)
            return proc

    def ended(self, proc: subprocess.Popen[str]) -> None:
        with self._lock:
            self._live.discard(proc)

    def terminate(self) -> None:
        with self._lock:
            self._terminated = True
            for proc in self._live:
                proc.terminate()


def _run(step: Step, cwd: Path, running: Running) -> Done:
    started = time.monotonic()
    try:
        proc = running.start(step, cwd)
    except OSError as exc:  # the interpreter or the script cannot be started at all
        return Done(step, 127, f"{exc}\n", time.monotonic() - started)
    if proc is None:
        return Done(step, -signal.SIGTERM, "not started: terminated\n", 0.0)
    try:
        output, _ = proc.communicate()
    finally:
        running.ended(proc)
    return Done(step, proc.returncode, output, time.monotonic() - started)


def run_all(todo: Sequence[Step], cwd: Path = REPO, out=sys.stdout, running: Running | None = None) -> list[Done]:
    """Run every step at once; print each one's output when it ends. Returns the failed steps."""
    failed: list[Done] = []
    if not todo:
        return failed
    running = running or Running()
    with ThreadPoolExecutor(max_workers=len(todo)) as pool:
        for future in as_completed([pool.submit(_run, step, cwd, running) for step in todo]):
            done = future.result()
            verdict = "done" if done.returncode == 0 else f"FAILED (exit status {done.returncode})"
            if done.output:
                out.write(done.output if done.output.endswith("\n") else done.output + "\n")
            out.write(f"[caches] {done.step.name}: {verdict} in {done.seconds:.1f} s\n")
            out.flush()
            if done.returncode != 0:
                failed.append(done)
    return failed


def main(todo: Sequence[Step] | None = None) -> int:
    running = Running()
    signal.signal(signal.SIGTERM, lambda _signum, _frame: running.terminate())
    failed = run_all(steps() if todo is None else todo, running=running)
    if failed:
        names = ", ".join(d.step.name for d in failed)
        print(f"[caches] failed: {names} (each one's output is above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
