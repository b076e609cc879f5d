"""The local cluster's Postgres side (deploy/local/cluster.py): a primary with a synchronous
streaming standby, made, started, stopped, killed, promoted and rejoined. The primary waits for the
standby's flush at each commit (synchronous_standby_names), so a promotion loses nothing committed;
a promoted standby writes alone (no standby to wait for) until the old primary rejoins. Which node
is the primary is kept in <state>/cluster/primary; the data folders under <state>/cluster/pg<N>.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import services as base  # deploy/local/services.py: Postgres binaries
from cluster_layout import DIR, pg_port

PG_NODES = (1, 2)
CONF_MARK = "# outbox-reaper cluster settings"


def dsn() -> str:
    hosts = ",".join(f"127.0.0.1:{pg_port(n)}" for n in PG_NODES)
    return f"postgresql://postgres@{hosts}/{base.PG_DB}?target_session_attrs=read-write"


def node_dsn(n: int, db: str = base.PG_DB) -> str:
    return f"postgresql://postgres@127.0.0.1:{pg_port(n)}/{db}"


def pg_data(n: int) -> Path:
    return DIR / f"pg{n}" / "data"


def pg_run(args: list[str], **kw) -> subprocess.CompletedProcess:
    return base.run(args, user=base.pg_user(), **kw)


def pg_ready(n: int) -> bool:
    r = base.run([str(base.pg_bindir() / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(pg_port(n))], check=False)
    return r.returncode == 0


def psql(n: int, query: str, db: str = "postgres", check: bool = True) -> str:
    r = base.run(
        [str(base.pg_bindir() / "psql"), "-X", "-h", "127.0.0.1", "-p", str(pg_port(n)), "-U", "postgres"]
        + ["-d", db, "-tAc", query],
        capture_output=True,
        check=False,
    )
    if check and r.returncode != 0:
        raise base.ServiceError(f"psql on node {n}: {query}: {r.stderr.strip()}")
    return r.stdout.strip() if r.returncode == 0 else ""


def in_recovery(n: int) -> bool | None:
    """True for a standby, False for a primary, None when the node does not answer."""
    if not pg_ready(n):
        return None
    out = psql(n, "SELECT pg_is_in_recovery()", check=False)
    return {"t": True, "f": False}.get(out)


def write_node_conf(n: int, *, standby_of: int | None, sync: bool, signal_file: bool = True) -> None:
    """The per-node settings, in a file the common postgresql.conf includes last (copies of a data
    folder carry it along, so every copy rewrites it)."""
    sockdir = DIR / f"pg{n}" / "run"
    lines = [
        f"port = {pg_port(n)}",
        f"unix_socket_directories = '{sockdir}'",
        f"cluster_name = 'node{n}'",
        f"synchronous_standby_names = '{'*' if sync else ''}'",
    ]
    if standby_of is not None:
        lines.append(
            f"primary_conninfo = 'host=127.0.0.1 port={pg_port(standby_of)} user=postgres application_name=node{n}'"
        )
    path = pg_data(n) / "node.conf"
    path.write_text("\n".join(lines) + "\n")
    user = base.pg_user()
    if user:
        shutil.chown(path, user)
    if not signal_file:  # a promotion: the server removes standby.signal itself
        return
    marker = pg_data(n) / "standby.signal"
    if standby_of is not None:
        marker.write_text("")
        if user:
            shutil.chown(marker, user)
    else:
        marker.unlink(missing_ok=True)


def _prepare_dirs(n: int) -> None:
    user = base.pg_user()
    folder = DIR / f"pg{n}"
    (folder / "run").mkdir(parents=True, exist_ok=True)
    if user:
        shutil.chown(folder, user)
        shutil.chown(folder / "run", user)
        for parent in folder.parents:
            if parent == Path("/"):
                break
            mode = parent.stat().st_mode
            if not mode & 0o001:
                os.chmod(parent, mode | 0o001)


def pg_init_primary(n: int) -> None:
    bindir, user = base.pg_bindir(), base.pg_user()

    def init(folder: Path, pass_fds: tuple[int, ...]) -> None:
        base.log(f"cluster: initdb node {n}")
        if user:
            shutil.chown(folder, user)
        os.chmod(folder, 0o700)
        base.run(
            [str(bindir / "initdb"), "-D", str(folder), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
            + ["--locale=C.UTF-8", "--no-instructions"],
            user=user,
            stdout=subprocess.DEVNULL,
            pass_fds=pass_fds,
        )
        with open(folder / "postgresql.conf", "a") as conf:
            conf.write(
                f"\n{CONF_MARK}\nlisten_addresses = '127.0.0.1'\n"
                "max_connections = 200\nshared_buffers = 128MB\nwork_mem = 8MB\nmax_wal_size = 1GB\n"
                "wal_level = replica\nmax_wal_senders = 10\nmax_replication_slots = 10\nhot_standby = on\n"
                "wal_log_hints = on\nwal_keep_size = 512MB\nsynchronous_commit = on\n"
                "autovacuum_naptime = 10s\nlog_min_messages = warning\n"
                "include_if_exists = 'node.conf'\n"
            )
        (folder / "node.conf").write_text("")

    base.first_use.populate(pg_data(n), init)
    if not (pg_data(n) / "node.conf").read_text().strip():
        write_node_conf(n, standby_of=None, sync=False)


def pg_basebackup(n: int, source: int) -> None:
    """Node n's data folder made anew as a copy of `source` (a running primary)."""
    bindir, user = base.pg_bindir(), base.pg_user()
    target = pg_data(n)
    _prepare_dirs(n)
    # Under the data folder's lock, which pg_basebackup holds too (pass_fds): a copy killed with
    # the script that started it still holds it until it ends, so the next one never works in the
    # same folder beside it; each copy goes to a folder of its own, renamed into place when whole.
    with base.first_use.locked(target.parent / f".{target.name}.lock") as lock_fd:
        for stale in target.parent.glob("data.partial*"):
            shutil.rmtree(stale, ignore_errors=True)
        base.log(f"cluster: pg_basebackup node {n} from node {source}")
        partial = Path(tempfile.mkdtemp(prefix="data.partial-", dir=target.parent))
        if user:
            shutil.chown(partial, user)
        base.run(
            [str(bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(pg_port(source)), "-U", "postgres"]
            + ["-D", str(partial), "-X", "stream", "-c", "fast"],
            user=user,
            stdout=subprocess.DEVNULL,
            pass_fds=(lock_fd,),
        )
        shutil.rmtree(target, ignore_errors=True)
        os.rename(partial, target)
        (target / base.first_use.COMPLETE).write_text("basebackup\n")
    write_node_conf(n, standby_of=source, sync=False)


def _postmaster(pidfile: Path) -> int | None:
    """The live postmaster of this node's data folder that its postmaster.pid names, if any."""
    return base.owned_pid(pidfile, "postgres", str(pidfile.parent))


def _postmaster_alive(pidfile: Path) -> bool:
    return _postmaster(pidfile) is not None


def pg_start(n: int) -> None:
    _prepare_dirs(n)
    data = pg_data(n)
    pidfile = data / "postmaster.pid"
    if base.port_open(pg_port(n)) and not _postmaster_alive(pidfile):
        raise base.ServiceError(base.port_taken(pg_port(n), f"postgres node {n}", data))
    if pg_ready(n):
        return
    if pidfile.exists() and not base.port_open(pg_port(n)) and not _postmaster_alive(pidfile):
        pidfile.unlink()  # left by a postmaster that is gone
    base.log(f"cluster: starting postgres node {n} on 127.0.0.1:{pg_port(n)}")
    logfile = DIR / f"pg{n}" / "postgres.log"
    r = pg_run(
        [str(base.pg_bindir() / "pg_ctl"), "-D", str(data), "-l", str(logfile), "-w", "-t", str(int(base.TIMEOUT))]
        + ["start"],
        check=False,
        stdout=subprocess.DEVNULL,
    )
    if r.returncode != 0 or not pg_ready(n):
        raise base.ServiceError(f"postgres node {n} did not start (pg_ctl exit {r.returncode}):\n{base.tail(logfile)}")


def pg_stop(n: int, mode: str = "fast") -> None:
    data = pg_data(n)
    if not _postmaster_alive(data / "postmaster.pid"):  # pg_ctl would signal whatever the file names
        return
    base.log(f"cluster: stopping postgres node {n} ({mode})")
    pg_run(
        [str(base.pg_bindir() / "pg_ctl"), "-D", str(data), "-m", mode, "-w", "stop"],
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pg_kill(n: int) -> None:
    """SIGKILL the postmaster (its children exit when they notice), as a crashed machine would."""
    pidfile = pg_data(n) / "postmaster.pid"
    pid = _postmaster(pidfile)
    if pid is None:  # none running: never a kill of whatever process has that number now
        return
    # Its backends too: left behind, they would hold its shared memory and keep it from starting.
    family = [pid, *children(pid)]
    for p in family:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in family):
        time.sleep(0.05)
    pidfile.unlink(missing_ok=True)  # its pid is free for any process now: the next start must not trust it


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def primary_file() -> Path:
    return DIR / "primary"


def current_primary() -> int:
    try:
        return int(primary_file().read_text())
    except (FileNotFoundError, ValueError):
        return 1


def set_primary(n: int) -> None:
    tmp = primary_file().with_suffix(f".{os.getpid()}")
    tmp.write_text(str(n))
    os.replace(tmp, primary_file())


def other(n: int) -> int:
    return 2 if n == 1 else 1


def streaming(primary: int, standby: int) -> bool:
    query = f"SELECT state FROM pg_stat_replication WHERE application_name = 'node{standby}'"
    return psql(primary, query, check=False) == "streaming"


def wait_streaming(primary: int, standby: int) -> None:
    deadline = time.monotonic() + base.TIMEOUT
    while time.monotonic() < deadline:
        if streaming(primary, standby):
            return
        time.sleep(0.1)
    logfile = DIR / f"pg{standby}" / "postgres.log"
    raise base.ServiceError(f"node {standby} does not stream from node {primary}:\n{base.tail(logfile)}")


def make_synchronous(primary: int) -> None:
    write_node_conf(primary, standby_of=None, sync=True)
    psql(primary, "SELECT pg_reload_conf()")


def pg_up() -> None:
    primary = current_primary()
    standby = other(primary)
    if not base.first_use.is_complete(pg_data(primary)):
        pg_init_primary(primary)
    pg_start(primary)
    if psql(primary, f"SELECT 1 FROM pg_database WHERE datname = '{base.PG_DB}'") != "1":
        psql(primary, f"CREATE DATABASE {base.PG_DB}")
    if not base.first_use.is_complete(pg_data(standby)):
        pg_basebackup(standby, primary)
    elif not (pg_data(standby) / "standby.signal").exists() or not (
        in_recovery(standby) is None or streaming(primary, standby)
    ):
        # an old primary never rejoined (it must not start as a second primary), or a standby
        # that does not follow this primary's timeline
        pg_stop(standby, "immediate")
        pg_basebackup(standby, primary)
    pg_start(standby)
    wait_streaming(primary, standby)
    make_synchronous(primary)
    base.log(f"cluster: postgres primary node {primary}, synchronous standby node {standby}")


def promote() -> int:
    """Stop the primary if it still runs (fencing it), promote the standby; returns the new primary.

    The new primary has no standby: it commits alone until `rejoin`."""
    old = current_primary()
    new = other(old)
    pg_stop(old, "immediate")
    base.log(f"cluster: promoting node {new}")
    write_node_conf(new, standby_of=None, sync=False, signal_file=False)
    pg_run([str(base.pg_bindir() / "pg_ctl"), "-D", str(pg_data(new)), "-w", "promote"], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + base.TIMEOUT
    while in_recovery(new) is not False:
        if time.monotonic() > deadline:
            raise base.ServiceError(f"node {new} did not leave recovery")
        time.sleep(0.05)
    psql(new, "SELECT pg_reload_conf()")
    set_primary(new)
    return new


def rejoin() -> None:
    """The node that is not the primary follows it as a synchronous standby (a new base backup)."""
    primary = current_primary()
    node = other(primary)
    if in_recovery(node) is True and streaming(primary, node):
        make_synchronous(primary)
        return
    # A new base backup rather than pg_rewind: the old primary may hold WAL past the fork point
    # that a rewind of a crashed server does not always undo, and the local database is small.
    pg_stop(node, "immediate")
    pg_basebackup(node, primary)
    write_node_conf(node, standby_of=primary, sync=False)
    pg_start(node)
    wait_streaming(primary, node)
    make_synchronous(primary)
