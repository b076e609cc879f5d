"""Spark for the tests and benchmarks: the local standalone cluster by default.

OUTBOX_SPARK_MASTER picks another master (e.g. `local[2,2]`; then the executors' Python is
OUTBOX_SPARK_PYTHON, default this interpreter). Without it, `deploy/local/services.py up --only
spark` starts (idempotently) the master and two workers, and the executors run the cluster's node
Python, which has the dependencies but not the tracker: every cluster test ships the tracker zip.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "deploy" / "local" / "services.py"


class SparkUnavailable(RuntimeError):
    pass


def master_and_python() -> tuple[str, str]:
    master = os.environ.get("OUTBOX_SPARK_MASTER")
    if master:
        return master, os.environ.get("OUTBOX_SPARK_PYTHON", sys.executable)
    r = subprocess.run(
        [sys.executable, str(SERVICES), "up", "--only", "spark"], capture_output=True, text=True, timeout=600
    )
    env = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line and not line.startswith("["))
    if r.returncode != 0 or "SPARK_MASTER" not in env:
        raise SparkUnavailable(f"could not bring up the local Spark cluster:\n{r.stdout}\n{r.stderr}")
    return env["SPARK_MASTER"], env["SPARK_NODE_PYTHON"]


def connector_jars() -> str:
    r = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "spark" / "jars.py")], capture_output=True, text=True, timeout=900
    )
    if r.returncode != 0:
        raise SparkUnavailable(f"could not resolve the Spark Kafka connector:\n{r.stderr[-3000:]}")
    return r.stdout.strip().split("=", 1)[1]


# The test JVMs (driver and executors) are short-lived and do little: C1 only and one GC thread
# spend far less CPU compiling and collecting on a small machine (executors killed by the tests
# start again, warm-up and all).
FAST_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def make_session(app_name: str, conf: dict[str, str] | None = None, *, kafka: bool = True):
    from tracker import spark as tspark

    master, python = master_and_python()
    conf = {"spark.driver.extraJavaOptions": FAST_JVM, "spark.executor.extraJavaOptions": FAST_JVM, **(conf or {})}
    return tspark.session(master, python=python, app_name=app_name, conf=conf, jars=connector_jars() if kafka else None)


def is_cluster(spark) -> bool:
    return spark.sparkContext.master.startswith("spark://")


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def executor_pids(app_id: str) -> list[int]:
    """The executor JVMs (CoarseGrainedExecutorBackend) of one application on this machine."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            cmd = _cmdline(int(entry))
            if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd and app_id in cmd:
                out.append(int(entry))
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """pid's child processes, recursively (an executor's Python daemon and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_own_executor() -> int:
    """From inside a task: SIGKILL the executor JVM this Python worker belongs to (executor loss)."""
    pid = os.getppid()
    while pid > 1:
        cmd = _cmdline(pid)
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in cmd:
            os.kill(pid, signal.SIGKILL)
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("this task does not run in an executor JVM (local mode?)")
