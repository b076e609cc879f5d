"""How busy the local cluster's Kafka nodes are, and waiting until they are quiet again.

A broker fault is healed by starting the killed node again. Its JVM then loads classes, compiles
and catches its replicas up for many seconds, on the same two cores as everything else: a fault
started meanwhile measures a failover on a machine the previous round made busy, not the fault.
bench.cluster therefore waits after each heal until the nodes use no more CPU than they did in
the steady load before the first fault (`Quiet.settle`), and reports, per round, how much CPU the
nodes used just before the fault (`Quiet.cores`), so that rounds can be told apart by how quiet
the machine was.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WINDOW = 2.0  # seconds each reading of the nodes' CPU covers


# the state folder of the cluster `services.py cluster` drives from this checkout (services_base.STATE)
STATE = Path(os.environ.get("OUTBOX_LOCAL_DIR", Path(__file__).resolve().parents[1] / ".local")).resolve()


class NoNodes(RuntimeError):
    """No Kafka node of this checkout's local cluster runs (or /proc does not show them)."""


def cluster_jvms(state: Path | None = None) -> list[int]:
    """The pids of this checkout's local cluster's Kafka nodes: `kafka.Kafka` JVMs whose properties
    file lies under `<state>/cluster/kafka-<layout>/` (not the single-node Kafka's, nor another
    checkout's cluster)."""
    mine = f"{state or STATE}/cluster/kafka-".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if b"kafka.Kafka" in args and any(a.startswith(mine) and a.endswith(b".properties") for a in args):
            pids.append(int(entry.name))
    return sorted(pids)


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User and system CPU seconds each process used so far (a process gone is left out)."""
    used = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        used[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)
    return used


def cores(window: float = WINDOW) -> float:
    """Cores the cluster's Kafka nodes used, on average, over the next `window` seconds: of the
    nodes running at both ends of it (one that ended or started meanwhile is left out). Raises
    NoNodes when none runs: a figure of 0 would read as a quiet cluster."""
    pids = cluster_jvms()
    if not pids:
        raise NoNodes(f"no Kafka node of the local cluster in {STATE} is running (or /proc hides them)")
    before, started = cpu_seconds(pids), time.monotonic()
    time.sleep(window)
    after = cpu_seconds(pids)
    used = sum(after[pid] - before[pid] for pid in after.keys() & before.keys())
    return round(used / (time.monotonic() - started), 3)


class Quiet:
    """The nodes' CPU in the steady load before any fault (`baseline`), and `settle`: wait until
    they are back to it after a heal."""

    def __init__(self, timeout: float = 60.0, slack: float = 1.25, floor: float = 0.05) -> None:
        self.timeout, self.slack, self.floor = timeout, slack, floor
        self.baseline: float | None = None

    def measure_baseline(self) -> float:
        self.baseline = cores()
        return self.baseline

    def settle(self) -> dict[str, float | bool]:
        """Read the nodes' CPU every WINDOW seconds until a reading is at most `slack` times the
        baseline plus `floor` cores, or `timeout` passed. Returns the seconds waited, the last
        reading and whether it was quiet."""
        assert self.baseline is not None, "measure_baseline() first"
        limit = self.baseline * self.slack + self.floor
        started = time.monotonic()
        while True:
            reading = cores()
            waited = round(time.monotonic() - started, 1)
            if reading <= limit:
                return {"settled_s": waited, "cores": reading, "quiet": True}
            if waited >= self.timeout:
                return {"settled_s": waited, "cores": reading, "quiet": False}
