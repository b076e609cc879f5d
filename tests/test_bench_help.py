"""Every benchmark is a command a reader can ask for help: `python -m bench.<name> --help` prints its
usage and exits 0 without touching a service (the connection settings here point nowhere)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = sorted(p.stem for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
NOWHERE = {
    "OUTBOX_TEST_DSN": "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1",
    "KAFKA_BOOTSTRAP": "127.0.0.1:1",
    "PGBOUNCER_DSN": "postgresql://nobody@127.0.0.1:1/none?connect_timeout=1",
}


def _bench(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m bench.<name> <args>`, with every service pointing nowhere."""
    return subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args],
        cwd=REPO,
        env={**os.environ, **NOWHERE, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_benchmarks_are_found():
    assert {"harvest", "tracker", "console", "cluster", "inbox"} <= set(COMMANDS), COMMANDS


@pytest.mark.parametrize("name", COMMANDS)
def test_a_benchmark_answers_help_without_running(name: str) -> None:
    done = _bench(name, "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]


@pytest.mark.parametrize("given", ["0", "-3", "1001"])
def test_the_fenced_partitions_out_of_range_are_refused_by_name_before_any_service(given: str) -> None:
    done = _bench("harvest", "--only", "fenced", "--fenced-partitions", given)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"--fenced-partitions must be between 1 and 1000, got {given}" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("given", ["1", "1000"])
def test_the_fenced_partitions_at_either_bound_pass_the_check_and_go_on_to_the_services(given: str) -> None:
    done = _bench("harvest", "--only", "fenced", "--fenced-partitions", given)
    # accepted: it goes on to connect, and fails there (the services point nowhere), not at the check
    assert done.returncode not in (0, 2), (done.returncode, done.stderr[-2000:])
    assert "must be between" not in done.stderr, done.stderr[-2000:]
    assert "connection failed" in done.stderr and "port 1" in done.stderr, done.stderr[-2000:]
