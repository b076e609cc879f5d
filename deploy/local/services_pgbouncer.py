"""The local PgBouncer (deploy/local/services.py `up --only pgbouncer`): Debian's package, in
transaction pooling mode in front of the local Postgres, state under <state>/pgbouncer.

Environment: OUTBOX_PGBOUNCER_PORT (56432).
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from services_base import STATE, TIMEOUT, ServiceError, ensure_debian_packages, log, owned_pid, port_open, run, tail
from services_postgres import PG_DB, PG_PORT, pg_bindir, pg_user

PGB_PORT = int(os.environ.get("OUTBOX_PGBOUNCER_PORT", "56432"))
PGB_DIR = STATE / "pgbouncer"


def pgb_dsn() -> str:
    return f"postgresql://postgres@127.0.0.1:{PGB_PORT}/{PG_DB}"


def pgb_config() -> str:
    # Trust, like the Postgres behind it (local use only). A server connection serves one client
    # transaction at a time; the sizes stay well below Postgres' max_connections (300), which the
    # tests also use directly.
    return f"""; written by deploy/local/services.py
[databases]
* = host=127.0.0.1 port={PG_PORT}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {PGB_PORT}
unix_socket_dir =
auth_type = trust
auth_file = {PGB_DIR / "userlist.txt"}
admin_users = postgres
stats_users = postgres
pool_mode = transaction
max_client_conn = 500
default_pool_size = 20
reserve_pool_size = 5
max_db_connections = 50
server_lifetime = 3600
ignore_startup_parameters = extra_float_digits
log_connections = 0
log_disconnections = 0
logfile = {PGB_DIR / "pgbouncer.log"}
pidfile = {PGB_DIR / "pgbouncer.pid"}
"""


def pgb_pid() -> int | None:
    """This layout's PgBouncer, if its pid file names one (services_base.owned_pid)."""
    return owned_pid(PGB_DIR / "pgbouncer.pid", "pgbouncer", str(PGB_DIR / "pgbouncer.ini"))


def pgb_ready() -> bool:
    """A query answered through PgBouncer (so Postgres behind it answers too)."""
    if not port_open(PGB_PORT):
        return False
    psql = pg_bindir() / "psql"
    r = run(
        [str(psql), "-h", "127.0.0.1", "-p", str(PGB_PORT), "-U", "postgres", "-d", PG_DB, "-tAc", "SELECT 1"],
        check=False,
        capture_output=True,
    )
    return r.returncode == 0 and r.stdout.strip() == "1"


def pgbouncer_up() -> None:
    if pgb_ready():
        log(f"pgbouncer already running on 127.0.0.1:{PGB_PORT}")
        return
    ensure_debian_packages("pgbouncer", "pgbouncer")
    user = pg_user()  # PgBouncer refuses to run as root, like initdb
    PGB_DIR.mkdir(parents=True, exist_ok=True)
    (PGB_DIR / "pgbouncer.ini").write_text(pgb_config())
    (PGB_DIR / "userlist.txt").write_text('"postgres" ""\n')
    if user:
        shutil.chown(PGB_DIR, user)
    if (pid := pgb_pid()) is not None:
        log(f"pgbouncer process {pid} exists but does not answer; waiting for it")
    else:
        (PGB_DIR / "pgbouncer.pid").unlink(missing_ok=True)
        log(f"starting pgbouncer on 127.0.0.1:{PGB_PORT} (transaction pooling)")
        exe = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        r = run([exe, "-d", str(PGB_DIR / "pgbouncer.ini")], user=user, check=False, capture_output=True)
        if r.returncode != 0:
            raise ServiceError(
                f"pgbouncer did not start (exit {r.returncode}): {r.stderr.strip()}\n{tail(PGB_DIR / 'pgbouncer.log')}"
            )
    started = time.monotonic()
    while time.monotonic() - started < TIMEOUT:
        if pgb_ready():
            log(f"pgbouncer ready: {pgb_dsn()}")
            return
        time.sleep(0.2)
    raise ServiceError(f"pgbouncer did not answer within {TIMEOUT:.0f}s; log tail:\n{tail(PGB_DIR / 'pgbouncer.log')}")


def pgbouncer_down() -> None:
    pid = pgb_pid()
    if pid is None:
        return
    log("stopping pgbouncer")
    os.kill(pid, signal.SIGTERM)  # immediate shutdown: client connections are closed
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pgb_pid() is not None:
        time.sleep(0.1)
    if pgb_pid() is not None:
        os.kill(pid, signal.SIGKILL)
    (PGB_DIR / "pgbouncer.pid").unlink(missing_ok=True)
