"""Local Spark standalone cluster for tests and benchmarks: one master and two workers.

Called by deploy/local/services.py (`up`, `down`, `status`); standard library only. The master and
workers are the pyspark distribution's own daemons (`bin/spark-class ...deploy.master.Master` /
`...deploy.worker.Worker`), each a separate JVM on private loopback ports, their logs and work
folders under <state>/spark/. Idempotent: `up` starts only what is not running.

It also makes the cluster's "node Python" (<state>/spark/node-python): an interpreter whose
site-packages sees the project venv's third-party packages (psycopg, pyarrow, ...) but NOT the
tracker, like a real cluster's nodes that have the dependencies installed but not our code. Jobs
ship the tracker to the executors themselves (tracker.spark.cluster: a zip added as a py-file).

Environment: OUTBOX_SPARK (0: `up`/`down` without --only leave Spark alone), OUTBOX_SPARK_HOME
(default: the pyspark package of this interpreter or of <repo>/.venv), OUTBOX_SPARK_MASTER_PORT
(57077), OUTBOX_SPARK_UI_PORT (58080; workers 58081..), OUTBOX_SPARK_WORKER_CORES (4, scheduling
slots, not physical cores), OUTBOX_SPARK_WORKER_MEMORY (2g: two 1g executors), OUTBOX_SPARK_DAEMON_MEMORY (256m).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import first_use  # deploy/local/first_use.py: the node venv is built aside and renamed into place
import services_base as base

REPO = Path(__file__).resolve().parents[2]
MASTER_PORT = int(os.environ.get("OUTBOX_SPARK_MASTER_PORT", "57077"))
UI_PORT = int(os.environ.get("OUTBOX_SPARK_UI_PORT", "58080"))
WORKERS = 2
WORKER_CORES = os.environ.get("OUTBOX_SPARK_WORKER_CORES", "4")
WORKER_MEMORY = os.environ.get("OUTBOX_SPARK_WORKER_MEMORY", "2g")
DAEMON_MEMORY = os.environ.get("OUTBOX_SPARK_DAEMON_MEMORY", "256m")
TIMEOUT = float(os.environ.get("OUTBOX_SERVICES_TIMEOUT", "90"))


class SparkClusterError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[services] {msg}", flush=True)


def enabled() -> bool:
    return os.environ.get("OUTBOX_SPARK", "1") != "0"


def master_url() -> str:
    return f"spark://127.0.0.1:{MASTER_PORT}"


def _pyspark_of(python: str) -> Path | None:
    r = subprocess.run(
        [python, "-c", "import pyspark, os; print(os.path.dirname(pyspark.__file__))"],
        capture_output=True,
        text=True,
        check=False,
    )
    return Path(r.stdout.strip()) if r.returncode == 0 and r.stdout.strip() else None


def venv_python() -> str | None:
    """The interpreter that has pyspark: this one, or the project's .venv."""
    for python in (sys.executable, str(REPO / ".venv" / "bin" / "python")):
        if Path(python).exists() and _pyspark_of(python) is not None:
            return python
    return None


def spark_home() -> Path | None:
    if os.environ.get("OUTBOX_SPARK_HOME"):
        return Path(os.environ["OUTBOX_SPARK_HOME"])
    python = venv_python()
    return _pyspark_of(python) if python else None


def node_python(state: Path) -> Path:
    """<state>/spark/node-python/bin/python: the venv's base interpreter, the venv's packages, no tracker."""
    python = venv_python()
    if python is None:
        raise SparkClusterError("pyspark is not installed: run `make venv` first")
    node = state / "spark" / "node-python"
    exe = node / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # Built aside and renamed into place, so an interrupted build is never taken for a venv; one made
    # before the completion mark is kept if its interpreter runs (a running cluster uses it).
    first_use.populate(
        node,
        lambda folder, fds: subprocess.run(
            [python, "-m", "venv", "--without-pip", str(folder)], check=True, pass_fds=fds
        ),
        adopt=lambda folder: subprocess.run([str(folder / "bin" / "python"), "-c", ""], check=False).returncode == 0,
    )
    node_site = subprocess.run(
        [str(exe), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # A path line, not the venv's own .pth files: the editable install's finder (which would make
    # the checkout's tracker importable) is never run, so executors only have the zip they are sent.
    pth = Path(node_site, "outbox_deps.pth")
    if _read(pth) != site + "\n":  # replaced whole: an executor starting now never reads it empty
        fresh = pth.with_name(f".outbox_deps.{os.getpid()}.tmp")
        fresh.write_text(site + "\n")
        os.replace(fresh, pth)
    return exe


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _alive(pidfile: Path, marker: str) -> int | None:
    """The live Spark daemon `pidfile` names, if it is this checkout's (its class path is this
    checkout's pyspark): a stale pid may now be another program's, or another checkout's Spark."""
    return base.owned_pid(pidfile, marker, str(spark_home() or REPO))


def master_state(timeout: float = 2.0) -> dict | None:
    """The master web UI's JSON (workers, apps), or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{UI_PORT}/json/", timeout=timeout) as r:
            return json.load(r)
    except (OSError, ValueError):
        return None


def alive_workers() -> int:
    st = master_state()
    return 0 if st is None else sum(w.get("state") == "ALIVE" for w in st.get("workers", []))


def _daemon_env(home: Path, sdir: Path) -> dict[str, str]:
    return dict(
        os.environ,
        SPARK_HOME=str(home),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
        SPARK_LOG_DIR=str(sdir),
        SPARK_NO_DAEMONIZE="1",
        # old applications' folders (shipped files, executor logs) are removed after an hour
        SPARK_WORKER_OPTS="-Dspark.worker.cleanup.enabled=true -Dspark.worker.cleanup.interval=600 "
        "-Dspark.worker.cleanup.appDataTtl=3600",
    )


def _start(home: Path, sdir: Path, name: str, args: list[str], host: str = "127.0.0.1") -> int:
    logfile = sdir / f"{name}.log"
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            ["bash", str(home / "bin" / "spark-class"), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(_daemon_env(home, sdir), SPARK_LOCAL_IP=host),
            cwd=sdir,
        )
    (sdir / f"{name}.pid").write_text(str(proc.pid))  # spark-class execs the JVM: same pid
    return proc.pid


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"


def up(state: Path) -> dict[str, str]:
    """Start what is not running; return SPARK_MASTER and SPARK_NODE_PYTHON."""
    home = spark_home()
    if home is None:
        raise SparkClusterError("pyspark is not installed (run `make venv`): no Spark cluster")
    if shutil.which("java") is None:
        raise SparkClusterError("Java (17+) is required by Spark: apt-get install openjdk-17-jre-headless")
    sdir = state / "spark"
    sdir.mkdir(parents=True, exist_ok=True)
    exe = node_python(state)
    env = {"SPARK_MASTER": master_url(), "SPARK_NODE_PYTHON": str(exe)}
    if alive_workers() >= WORKERS:
        log(f"spark already running: {master_url()} with {WORKERS} workers")
        return env
    started = time.monotonic()
    if _alive(sdir / "master.pid", "deploy.master.Master") is None and not base.port_open(MASTER_PORT):
        log(f"starting spark master on {master_url()} (UI 127.0.0.1:{UI_PORT})")
        _start(
            home,
            sdir,
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(MASTER_PORT),
                "--webui-port",
                str(UI_PORT),
            ],
        )
    while master_state() is None:
        if time.monotonic() - started > TIMEOUT:
            raise SparkClusterError(f"spark master did not answer within {TIMEOUT:.0f}s:\n{_tail(sdir / 'master.log')}")
        time.sleep(0.3)
    for i in range(1, WORKERS + 1):
        if _alive(sdir / f"worker-{i}.pid", "deploy.worker.Worker") is None:
            work = sdir / f"work-{i}"
            work.mkdir(exist_ok=True)
            # Each worker is a "host" of its own (127.0.0.1, 127.0.0.2: all loopback): Spark never
            # runs a speculative copy on the host of the attempt it copies.
            host = f"127.0.0.{i}"
            log(f"starting spark worker {i} on {host} ({WORKER_CORES} cores, {WORKER_MEMORY})")
            _start(
                home,
                sdir,
                f"worker-{i}",
                [
                    "org.apache.spark.deploy.worker.Worker",
                    master_url(),
                    "--host",
                    host,
                    "--port",
                    str(MASTER_PORT + i),
                    "--webui-port",
                    str(UI_PORT + i),
                    "--cores",
                    WORKER_CORES,
                    "--memory",
                    WORKER_MEMORY,
                    "--work-dir",
                    str(work),
                ],
                host=host,
            )
    while alive_workers() < WORKERS:
        if time.monotonic() - started > TIMEOUT:
            raise SparkClusterError(
                f"spark workers did not register within {TIMEOUT:.0f}s:\n"
                + "\n".join(_tail(sdir / f"worker-{i}.log") for i in range(1, WORKERS + 1))
            )
        time.sleep(0.3)
    log(f"spark ready in {time.monotonic() - started:.1f}s: {master_url()}, {WORKERS} workers")
    return env


def down(state: Path) -> None:
    sdir = state / "spark"
    for name, marker in [
        *((f"worker-{i}", "deploy.worker.Worker") for i in range(WORKERS, 0, -1)),
        ("master", "deploy.master.Master"),
    ]:
        pid = _alive(sdir / f"{name}.pid", marker)
        if pid is None:
            continue
        log(f"stopping spark {name}")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and _alive(sdir / f"{name}.pid", marker) is not None:
            time.sleep(0.2)
        if _alive(sdir / f"{name}.pid", marker) is not None:
            os.kill(pid, signal.SIGKILL)
        (sdir / f"{name}.pid").unlink(missing_ok=True)


def status() -> tuple[bool, str]:
    n = alive_workers()
    return n >= WORKERS, (f"up {master_url()} ({n} workers)" if master_state() is not None else "down")


__all__ = ["SparkClusterError", "up", "down", "status", "enabled", "master_url", "node_python"]
