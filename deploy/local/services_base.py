"""What the local services (deploy/local/services.py and the cluster beside it) share: the state
folder, the start-up timeout, their error, their log lines and running a command, as another user.

Standard library only, like every module here: they run before the project's virtualenv exists.
Environment: OUTBOX_LOCAL_DIR (state folder, <repo>/.local), OUTBOX_SERVICES_TIMEOUT (90 s).
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import first_use  # deploy/local/first_use.py: downloads safe under concurrency and interruption

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("OUTBOX_LOCAL_DIR", REPO / ".local")).resolve()
TIMEOUT = float(os.environ.get("OUTBOX_SERVICES_TIMEOUT", "90"))


class ServiceError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[services] {msg}", flush=True)


def run(cmd: list[str], *, user: str | None = None, check: bool = True, **kw) -> subprocess.CompletedProcess:
    if user is not None:
        cmd = ["runuser", "-u", user, "--", *cmd]
    return subprocess.run(cmd, check=check, text=True, **kw)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def port_taken(port: int, what: str, state: Path) -> str:
    """Why a node is not started: its port answers, but not from this checkout's own process. A
    second checkout's local cluster on the same ports would otherwise take the first one's nodes
    for its own (each answers), drive them with pid files of its own, and start JVMs that cannot
    bind."""
    return (
        f"127.0.0.1:{port}, the port of {what}, is held by a process this checkout did not start "
        f"(its state is in {state}); another checkout's local cluster? Stop that one, or give this "
        "one other ports with OUTBOX_CLUSTER_PORT_BASE"
    )


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"


def ensure_debian_packages(command: str, package: str) -> None:
    """Install a missing tool from Debian's packages (root, or sudo), so a fresh machine needs nothing by hand."""
    first_use.apt_install(package, first_use.has_command(command), log=log)


def owned_pid(pidfile: Path, *markers: str) -> int | None:
    """The live process `pidfile` names if its command line holds every one of `markers` (the
    program and this layout's own configuration or data path), else None: a pid file outlives its
    process (a kill, a reboot), and its number may now be another program's, even another
    checkout's service of the same kind, which `down` must never signal. An empty or garbled file,
    and a zombie, name nothing. An empty command line (the JVM execs itself at start) counts as ours."""
    try:
        text = pidfile.read_text().split()
        pid = int(text[0]) if text else 0
        if pid <= 0:
            return None
        try:
            os.kill(pid, 0)
        except PermissionError:
            pass  # alive, another user's (a server run as postgres, checked by a non-root user): its command line says
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):  # gone, never there, unreadable: ProcessLookupError is an OSError
        return None
    if state == "Z":
        return None
    args = cmdline.split(b"\0")
    if cmdline and not all(any(m.encode() in a for a in args) for m in markers):
        return None
    return pid
