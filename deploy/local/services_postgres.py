"""The local PostgreSQL (deploy/local/services.py `up --only postgres`): Debian's packages, one
cluster under <state>/postgres, database `outbox`, trust authentication on 127.0.0.1 only.

As root, initdb and the server run as Debian's `postgres` user. Environment: OUTBOX_PG_PORT (55432).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import first_use  # deploy/local/first_use.py: downloads safe under concurrency and interruption
from services_base import STATE, TIMEOUT, ServiceError, log, owned_pid, port_open, run, tail

PG_PORT = int(os.environ.get("OUTBOX_PG_PORT", "55432"))
PG_DB = "outbox"
PG_DIR = STATE / "postgres"


def pg_bindir() -> Path:
    def found() -> list[str]:
        return sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))

    if not found():
        first_use.apt_install("postgresql", lambda: bool(found()), log=log)
    return Path(found()[-1]).parent


def pg_user() -> str | None:
    """initdb refuses root; as root run the server as Debian's `postgres` user."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        run(["useradd", "--system", "--home-dir", "/var/lib/postgresql", "--shell", "/bin/bash", "postgres"])
    return "postgres"


PG_CONF_MARK = "# outbox-reaper local settings"


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def pg_dsn() -> str:
    return f"postgresql://postgres@127.0.0.1:{PG_PORT}/{PG_DB}"


def pg_ready(bindir: Path) -> bool:
    r = run([str(bindir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(PG_PORT)], check=False)
    return r.returncode == 0


def pg_up() -> None:
    bindir = pg_bindir()
    user = pg_user()
    data, logfile, sockdir = PG_DIR / "data", PG_DIR / "postgres.log", PG_DIR / "run"
    PG_DIR.mkdir(parents=True, exist_ok=True)
    sockdir.mkdir(exist_ok=True)
    if user:
        # The server user must be able to reach its folder through the checkout's parents.
        shutil.chown(PG_DIR, user)
        shutil.chown(sockdir, user)
        for parent in PG_DIR.parents:
            if parent == Path("/"):
                break
            mode = parent.stat().st_mode
            if not mode & 0o001:
                os.chmod(parent, mode | 0o001)
    if not first_use.is_complete(data):

        def init(folder: Path, pass_fds: tuple[int, ...]) -> None:
            log(f"initdb {data}")
            if user:
                shutil.chown(folder, user)
            os.chmod(folder, 0o700)  # Postgres refuses a data folder others can read
            run(
                [
                    str(bindir / "initdb"),
                    "-D",
                    str(folder),
                    "-U",
                    "postgres",
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                    "--no-instructions",
                ],
                user=user,
                stdout=subprocess.DEVNULL,
                pass_fds=pass_fds,
            )
            with open(folder / "postgresql.conf", "a") as conf:
                conf.write(
                    f"\n{PG_CONF_MARK}\n"
                    f"listen_addresses = '127.0.0.1'\nport = {PG_PORT}\n"
                    f"unix_socket_directories = '{sockdir}'\n"
                    "max_connections = 300\nshared_buffers = 512MB\nwork_mem = 16MB\n"
                    "maintenance_work_mem = 256MB\nmax_wal_size = 4GB\ncheckpoint_timeout = 15min\n"
                    "wal_level = replica\nmax_prepared_transactions = 0\n"
                    "autovacuum_naptime = 10s\nlog_min_messages = warning\n"
                )

        # A cluster made before the completion mark is whole if initdb got as far as our settings.
        first_use.populate(data, init, adopt=lambda d: PG_CONF_MARK in _read(d / "postgresql.conf"))
    if pg_ready(bindir):
        log(f"postgres already running on 127.0.0.1:{PG_PORT}")
    else:
        pidfile = data / "postmaster.pid"
        if pidfile.exists() and not port_open(PG_PORT) and owned_pid(pidfile, "postgres", str(data)) is None:
            # Left by a killed server (a previous machine run), empty (killed while writing it), or
            # naming a pid another process has now: Postgres would refuse to start beside it for good.
            pidfile.unlink()
        log(f"starting postgres on 127.0.0.1:{PG_PORT}")
        r = run(
            [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(logfile), "-w", "-t", str(int(TIMEOUT)), "start"],
            user=user,
            check=False,
            stdout=subprocess.DEVNULL,
        )
        if r.returncode != 0 or not pg_ready(bindir):
            raise ServiceError(f"postgres did not start (pg_ctl exit {r.returncode}):\n{tail(logfile)}")
    exists = run(
        [
            str(bindir / "psql"),
            "-h",
            "127.0.0.1",
            "-p",
            str(PG_PORT),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-tAc",
            f"SELECT 1 FROM pg_database WHERE datname = '{PG_DB}'",
        ],
        capture_output=True,
    )
    if exists.stdout.strip() != "1":
        run([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(PG_PORT), "-U", "postgres", PG_DB])
    log(f"postgres ready: {pg_dsn()}")


def pg_down() -> None:
    data = PG_DIR / "data"
    if not (data / "PG_VERSION").exists():
        return
    bindir = pg_bindir()
    if pg_ready(bindir) or (data / "postmaster.pid").exists():
        log("stopping postgres")
        run(
            [str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            user=pg_user(),
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
