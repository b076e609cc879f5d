"""A local production-like topology: three Kafka brokers (KRaft, each node broker + controller, one
JVM each) and a Postgres primary with a synchronous streaming standby. For fault tests and benchmarks.

    python3 deploy/local/services.py cluster up|down|status|env
    python3 deploy/local/services.py cluster kill-broker|stop-broker|start-broker|pause-broker|resume-broker N
    python3 deploy/local/services.py cluster controller        # node id of the active KRaft controller
    python3 deploy/local/services.py cluster pg-kill|pg-start N   # Postgres node 1 or 2
    python3 deploy/local/services.py cluster promote           # stop the primary (if up), promote the standby
    python3 deploy/local/services.py cluster rejoin            # the old primary follows the new one

Ports (private, apart from the single-node services; OUTBOX_CLUSTER_PORT_BASE, default 25400):
Postgres nodes base+1, base+2; Kafka brokers base+11..13, their controller listeners base+21..23.
Topics get replication factor 3 and min.insync.replicas 2 by default. The Postgres primary waits
for the standby's flush at each commit (synchronous_standby_names), so a promotion loses nothing
committed; a promoted standby writes alone (no standby to wait for) until the old primary rejoins.
Kafka's heap per broker: OUTBOX_CLUSTER_KAFKA_HEAP (384m). State under <state>/cluster.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import services as base  # deploy/local/services.py: Postgres binaries, Kafka jars, Java

PORT_BASE = int(os.environ.get("OUTBOX_CLUSTER_PORT_BASE", "25400"))
HEAP = os.environ.get("OUTBOX_CLUSTER_KAFKA_HEAP", "384m")
NODES = (1, 2, 3)
PG_NODES = (1, 2)
DIR = base.STATE / "cluster"
CONF_MARK = "# outbox-reaper cluster settings"


def pg_port(n: int) -> int:
    return PORT_BASE + n


def broker_port(n: int) -> int:
    return PORT_BASE + 10 + n


def controller_port(n: int) -> int:
    return PORT_BASE + 20 + n


def dsn() -> str:
    hosts = ",".join(f"127.0.0.1:{pg_port(n)}" for n in PG_NODES)
    return f"postgresql://postgres@{hosts}/{base.PG_DB}?target_session_attrs=read-write"


def node_dsn(n: int, db: str = base.PG_DB) -> str:
    return f"postgresql://postgres@127.0.0.1:{pg_port(n)}/{db}"


def bootstrap() -> str:
    return ",".join(f"127.0.0.1:{broker_port(n)}" for n in NODES)


def env_lines() -> list[str]:
    return [f"CLUSTER_PG_DSN={dsn()}", f"CLUSTER_KAFKA_BOOTSTRAP={bootstrap()}"] + [
        f"CLUSTER_PG_NODE{n}={node_dsn(n)}" for n in PG_NODES
    ]


# ---------------------------------------------------------------- Kafka


def kafka_dir(n: int) -> Path:
    return DIR / f"kafka{n}"


def kafka_props(n: int) -> str:
    voters = ",".join(f"{i}@127.0.0.1:{controller_port(i)}" for i in NODES)
    return f"""# written by deploy/local/cluster.py
process.roles=broker,controller
node.id={n}
controller.quorum.voters={voters}
listeners=PLAINTEXT://127.0.0.1:{broker_port(n)},CONTROLLER://127.0.0.1:{controller_port(n)}
advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port(n)}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={kafka_dir(n) / "data"}
auto.create.topics.enable=false
num.partitions=1
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
group.initial.rebalance.delay.ms=0
group.min.session.timeout.ms=1000
# a lost broker is fenced within about 2 s (the controllers' broker session; Kafka's default is
# 9 s), and its leaderships move at once; brokers heartbeat every 250 ms to keep theirs
broker.session.timeout.ms=2000
broker.heartbeat.interval.ms=250
replica.lag.time.max.ms=5000
unclean.leader.election.enable=false
log.retention.hours=2
log.segment.bytes=52428800
delete.topic.enable=true
"""


def cluster_id() -> str:
    path = DIR / "kafka-cluster-id"
    # an id starting with '-' (written by an older version of this script) never formatted a
    # broker, so it is safe to replace
    if not path.exists() or path.read_text().strip().startswith("-") or not path.read_text().strip():
        tmp = path.with_suffix(f".{os.getpid()}")
        tmp.write_text(base.new_kafka_cluster_id())
        os.replace(tmp, path)
    return path.read_text().strip()


def broker_pid(n: int) -> int | None:
    try:
        pid = int((kafka_dir(n) / "kafka.pid").read_text())
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None
    try:  # a pid reused by another program is not our broker (empty while the JVM execs itself)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if cmdline and b"kafka.Kafka" not in cmdline:
        return None
    try:  # a killed broker nobody has reaped yet (a zombie, no cmdline either) is gone
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return None
    except (OSError, IndexError):
        return None
    return pid


def broker_start(n: int, wait: bool = True) -> None:
    if broker_pid(n) is None:
        lib = base.kafka_jars()
        folder = kafka_dir(n)
        folder.mkdir(parents=True, exist_ok=True)
        props = folder / "server.properties"
        props.write_text(kafka_props(n))
        if not (folder / "data" / "meta.properties").exists():
            base.log(f"cluster: formatting KRaft storage of broker {n}")
            r = base.run(
                base.java_cmd(lib, "kafka.tools.StorageTool", "format", "-t", cluster_id(), "-c", str(props)),
                check=False,
                capture_output=True,
            )
            if r.returncode != 0:
                raise base.ServiceError(f"StorageTool format failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        base.log(f"cluster: starting kafka broker {n} on 127.0.0.1:{broker_port(n)}")
        with open(folder / "kafka.log", "ab") as out:
            proc = subprocess.Popen(
                base.java_cmd(lib, "kafka.Kafka", str(props), heap=HEAP),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (folder / "kafka.pid").write_text(str(proc.pid))
    if wait:
        wait_brokers([n])


def wait_brokers(nodes: list[int] | tuple[int, ...]) -> None:
    """Each of `nodes` answers a metadata request."""
    started = time.monotonic()
    pending = list(nodes)
    while pending and time.monotonic() - started < base.TIMEOUT * 2:
        pending = [n for n in pending if not base.kafka_metadata_ok(broker_port(n))]
        for n in pending:
            if broker_pid(n) is None:
                raise base.ServiceError(f"kafka broker {n} exited; log tail:\n{base.tail(kafka_dir(n) / 'kafka.log')}")
        if pending:
            time.sleep(0.25)
    if pending:
        n = pending[0]
        raise base.ServiceError(f"kafka broker {n} did not answer; log tail:\n{base.tail(kafka_dir(n) / 'kafka.log')}")


def broker_signal(n: int, sig: signal.Signals, wait: float = 0.0) -> float | None:
    """Signal broker n; for SIGTERM/SIGKILL, wait until its process has ended. Returns when the
    signal was sent (time.monotonic(), the same clock in every process), None if it was not running."""
    pid = broker_pid(n)
    if pid is None:
        return None
    os.kill(pid, sig)
    sent = time.monotonic()
    if sig in (signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGTERM:
            os.kill(pid, signal.SIGCONT)  # a paused broker cannot shut down
        deadline = time.monotonic() + (wait or 60)
        while time.monotonic() < deadline and broker_pid(n) is not None:
            time.sleep(0.05)
        if broker_pid(n) is not None:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        (kafka_dir(n) / "kafka.pid").unlink(missing_ok=True)
    return sent


def active_controller() -> int | None:
    """The KRaft quorum's leader, as the most recent quorum-state file of a live node says."""
    best: tuple[int, int] | None = None
    for n in NODES:
        if broker_pid(n) is None:
            continue
        try:
            state = json.loads((kafka_dir(n) / "data" / "__cluster_metadata-0" / "quorum-state").read_text())
        except (OSError, ValueError):
            continue
        epoch, leader = state.get("leaderEpoch", -1), state.get("leaderId", -1)
        if leader in NODES and (best is None or epoch > best[0]):
            best = (epoch, leader)
    return best[1] if best else None


# ---------------------------------------------------------------- Postgres


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
    partial = target.with_name("data.partial")
    _prepare_dirs(n)
    shutil.rmtree(partial, ignore_errors=True)
    base.log(f"cluster: pg_basebackup node {n} from node {source}")
    partial.mkdir(mode=0o700)
    if user:
        shutil.chown(partial, user)
    base.run(
        [str(bindir / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(pg_port(source)), "-U", "postgres"]
        + ["-D", str(partial), "-X", "stream", "-c", "fast"],
        user=user,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(target, ignore_errors=True)
    os.rename(partial, target)
    (target / base.first_use.COMPLETE).write_text("basebackup\n")
    write_node_conf(n, standby_of=source, sync=False)


def pg_start(n: int) -> None:
    _prepare_dirs(n)
    if pg_ready(n):
        return
    data = pg_data(n)
    pidfile = data / "postmaster.pid"
    if pidfile.exists() and not base.port_open(pg_port(n)):
        try:
            os.kill(int(pidfile.read_text().split()[0]), 0)
        except (ProcessLookupError, ValueError):
            pidfile.unlink()
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
    if not (data / "postmaster.pid").exists():
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
    try:
        pid = int(pidfile.read_text().split()[0])
    except (FileNotFoundError, ValueError):
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


# ---------------------------------------------------------------- entry point


def up() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    pg_up()
    for n in NODES:
        broker_signal(n, signal.SIGCONT)  # one left paused by a test
        broker_start(n, wait=False)
    wait_brokers(NODES)


def down() -> None:
    for n in NODES:
        broker_signal(n, signal.SIGTERM, wait=30)
    for n in PG_NODES:
        if (pg_data(n) / "PG_VERSION").exists():
            pg_stop(n, "fast")


def status() -> int:
    ok = True
    for n in NODES:
        alive = broker_pid(n) is not None and base.kafka_metadata_ok(broker_port(n))
        ok &= alive
        print(f"kafka broker {n}: {'up' if alive else 'down'} 127.0.0.1:{broker_port(n)}")
    print(f"kafka controller: {active_controller()}")
    for n in PG_NODES:
        role = {None: "down", True: "standby", False: "primary"}[in_recovery(n)]
        ok &= role != "down"
        print(f"postgres node {n}: {role} 127.0.0.1:{pg_port(n)}")
    print("\n".join(env_lines()))
    return 0 if ok else 3


def main(action: str, node: int | None) -> int:
    DIR.mkdir(parents=True, exist_ok=True)
    if action in {"kill-broker", "stop-broker", "start-broker", "pause-broker", "resume-broker", "pg-kill", "pg-start"}:
        limit = PG_NODES if action.startswith("pg-") else NODES
        if node not in limit:
            raise base.ServiceError(f"{action} needs a node number among {list(limit)}, got {node!r}")
    # Several test workers may ask for `up` at once: one at a time does the work. Signals to one
    # broker need no lock (and must not wait behind a long `up`).
    # kill-broker and pause-broker print when the signal was sent (signalled_at=<time.monotonic()>):
    # a benchmark counts a fault's gap from it, not from when this command returned.
    if action == "kill-broker":
        print(f"signalled_at={broker_signal(node, signal.SIGKILL)}")
    elif action == "pause-broker":
        print(f"signalled_at={broker_signal(node, signal.SIGSTOP)}")
    elif action == "resume-broker":
        broker_signal(node, signal.SIGCONT)
    elif action == "controller":
        print(active_controller())
    elif action == "env":
        print("\n".join(f"export {line}" for line in env_lines()))
    elif action == "status":
        return status()
    else:
        with open(DIR / "cluster.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if action == "up":
                up()
                print("\n".join(env_lines()))
            elif action == "down":
                down()
            elif action == "stop-broker":
                broker_signal(node, signal.SIGTERM)
            elif action == "start-broker":
                broker_start(node)
            elif action == "pg-kill":
                pg_kill(node)
            elif action == "pg-start":
                pg_start(node)
            elif action == "promote":
                print(f"primary=node{promote()}")
            elif action == "rejoin":
                rejoin()
    return 0


ACTIONS = [
    "up",
    "down",
    "status",
    "env",
    "kill-broker",
    "stop-broker",
    "start-broker",
    "pause-broker",
    "resume-broker",
    "controller",
    "pg-kill",
    "pg-start",
    "promote",
    "rejoin",
]
