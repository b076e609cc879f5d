#!/usr/bin/env python3
"""Local PostgreSQL, PgBouncer and Apache Kafka (single KRaft node) for development, tests and CI.

    python3 deploy/local/services.py up|down|status|env [--only postgres|kafka|pgbouncer|spark]
    python3 deploy/local/services.py fetch     # only resolve Kafka's jars into the machine's cache
    python3 deploy/local/services.py cluster up|down|status|...   # three brokers + a Postgres standby
                                               # (deploy/local/cluster.py), on ports of their own

Idempotent. Everything lives under <repo>/.local (git-ignored). PostgreSQL comes from Debian's
packages (apt-get installs it when missing); Kafka from its jars on Maven Central, resolved once by
`mvn dependency:copy-dependencies` on deploy/local/kafka/pom.xml. Standard library only, so it runs
before the project's virtualenv exists. Plus a Spark standalone master and two workers
(deploy/local/spark_cluster.py), from the venv's pyspark: `up` skips it while pyspark is not
installed (`make venv`; `--only spark` fails instead); OUTBOX_SPARK=0 leaves Spark out of `up`/`down`.

Downloads go through deploy/local/first_use.py (safe for several processes at once and for
interruption). Environment: OUTBOX_CACHE_DIR (per-machine cache, ~/.cache/outbox-reaper),
OUTBOX_KAFKA_LIB_CACHE (Kafka's jars, <cache>/kafka-lib), OUTBOX_LOCAL_DIR (state folder), OUTBOX_PG_PORT (55432), OUTBOX_KAFKA_PORT (59092),
OUTBOX_KAFKA_CONTROLLER_PORT (59093), OUTBOX_KAFKA_HEAP (512m), OUTBOX_SERVICES_TIMEOUT (90 s),
OUTBOX_PGBOUNCER_PORT (56432: PgBouncer in transaction pooling mode in front of the Postgres).
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import glob
import hashlib
import os
import pwd
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import first_use  # deploy/local/first_use.py: downloads safe under concurrency and interruption
import spark_cluster  # deploy/local/spark_cluster.py: Spark standalone master + 2 workers

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("OUTBOX_LOCAL_DIR", REPO / ".local")).resolve()
PG_PORT = int(os.environ.get("OUTBOX_PG_PORT", "55432"))
KAFKA_PORT = int(os.environ.get("OUTBOX_KAFKA_PORT", "59092"))
CONTROLLER_PORT = int(os.environ.get("OUTBOX_KAFKA_CONTROLLER_PORT", "59093"))
KAFKA_HEAP = os.environ.get("OUTBOX_KAFKA_HEAP", "512m")
TIMEOUT = float(os.environ.get("OUTBOX_SERVICES_TIMEOUT", "90"))
PGB_PORT = int(os.environ.get("OUTBOX_PGBOUNCER_PORT", "56432"))
PG_DB = "outbox"
PG_DIR = STATE / "postgres"
KAFKA_DIR = STATE / "kafka"
PGB_DIR = STATE / "pgbouncer"


def kafka_lib_cache() -> Path:
    """Kafka's jars, shared by every checkout on the machine (read at each call: tests move it)."""
    return Path(os.environ.get("OUTBOX_KAFKA_LIB_CACHE") or first_use.cache_root() / "kafka-lib")


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


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"


# ---------------------------------------------------------------- PostgreSQL


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
        if pidfile.exists() and not port_open(PG_PORT):
            pid = int(pidfile.read_text().split()[0])
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                pidfile.unlink()  # left by a killed server on a previous machine run
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


# ---------------------------------------------------------------- PgBouncer (transaction pooling)


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
    try:
        pid = int((PGB_DIR / "pgbouncer.pid").read_text())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None


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


# ---------------------------------------------------------------- Kafka


def kafka_metadata_ok(port: int = KAFKA_PORT, timeout: float = 2.0) -> bool:
    """Send a Kafka Metadata request (v1, all topics) and check that a broker list comes back."""
    client = b"outbox-reaper-services"
    body = struct.pack(">hhih", 3, 1, 7, len(client)) + client + struct.pack(">i", -1)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(struct.pack(">i", len(body)) + body)
            head = s.recv(4, socket.MSG_WAITALL)
            if len(head) < 4:
                return False
            (size,) = struct.unpack(">i", head)
            payload = s.recv(size, socket.MSG_WAITALL)
    except OSError:
        return False
    if len(payload) < 8:
        return False
    correlation, brokers = struct.unpack(">ii", payload[:8])
    return correlation == 7 and brokers >= 1


def ensure_debian_packages(command: str, package: str) -> None:
    """Install a missing tool from Debian's packages (root, or sudo), so a fresh machine needs nothing by hand."""
    first_use.apt_install(package, first_use.has_command(command), log=log)


def kafka_jars() -> Path:
    """Kafka's jars, resolved from Maven Central once per machine (safe for two resolvers at once)."""
    pom = HERE / "kafka" / "pom.xml"
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:16]
    cache = kafka_lib_cache() / digest
    if first_use.is_complete(cache):
        return cache
    ensure_debian_packages("java", "openjdk-17-jre-headless")
    ensure_debian_packages("mvn", "maven")

    def resolve(folder: Path, pass_fds: tuple[int, ...]) -> None:
        log(f"resolving Kafka jars from Maven Central into {cache}")
        args = ["-q", "-B", "-f", str(pom), "dependency:copy-dependencies", "-DincludeScope=runtime"]
        r = first_use.maven([*args, f"-DoutputDirectory={folder}"], pass_fds=pass_fds)
        if r.returncode != 0:
            raise ServiceError(f"mvn could not resolve Kafka's jars:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        if not any(folder.glob("kafka_*.jar")):
            raise ServiceError(f"mvn resolved no kafka_*.jar into {folder}")

    return first_use.populate(cache, resolve)


def kafka_props(logdir: Path) -> str:
    return f"""# written by deploy/local/services.py
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:{CONTROLLER_PORT}
listeners=PLAINTEXT://127.0.0.1:{KAFKA_PORT},CONTROLLER://127.0.0.1:{CONTROLLER_PORT}
advertised.listeners=PLAINTEXT://127.0.0.1:{KAFKA_PORT}
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={logdir}
auto.create.topics.enable=false
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
group.initial.rebalance.delay.ms=0
# tests run leader election with short session timeouts
group.min.session.timeout.ms=1000
log.retention.hours=6
log.segment.bytes=104857600
delete.topic.enable=true
"""


def java_cmd(lib: Path, main: str, *args: str, heap: str | None = None, jvm_opts: tuple[str, ...] = ()) -> list[str]:
    ensure_debian_packages("java", "openjdk-17-jre-headless")
    java = shutil.which("java")
    if java is None:
        raise ServiceError("Java (17+) is required to run Kafka: apt-get install openjdk-17-jre-headless")
    jvm = [java]
    if heap:
        jvm += [f"-Xms{heap}", f"-Xmx{heap}", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20"]
    jvm += list(jvm_opts)
    jvm += [f"-Dlog4j2.configurationFile={HERE / 'kafka' / 'log4j2.yaml'}", "-cp", f"{lib}/*", main, *args]
    return jvm


def new_kafka_cluster_id() -> str:
    """A random KRaft cluster id that the storage tool's argument parser accepts.

    URL-safe base64 of 16 random bytes, like Kafka's own ids; one in 64 of those starts with '-',
    which the tool reads as an option ("--cluster-id: expected one argument"). Kafka's own
    generator redraws those, and so does this.
    """
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def kafka_pid() -> int | None:
    pidfile = KAFKA_DIR / "kafka.pid"
    try:
        pid = int(pidfile.read_text())
        os.kill(pid, 0)
        return pid
    except (FileNotFoundError, ValueError, ProcessLookupError):
        return None


def kafka_up() -> None:
    if kafka_metadata_ok():
        log(f"kafka already running on 127.0.0.1:{KAFKA_PORT}")
        return
    lib = kafka_jars()
    KAFKA_DIR.mkdir(parents=True, exist_ok=True)
    data, props, logfile = KAFKA_DIR / "data", KAFKA_DIR / "server.properties", KAFKA_DIR / "kafka.log"
    props.write_text(kafka_props(data))
    if not (data / "meta.properties").exists():
        cid = new_kafka_cluster_id()
        log(f"formatting KRaft storage {data}")
        r = run(
            java_cmd(lib, "kafka.tools.StorageTool", "format", "-t", cid, "-c", str(props)),
            check=False,
            capture_output=True,
        )
        if r.returncode != 0:
            raise ServiceError(f"StorageTool format failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    if (pid := kafka_pid()) is not None:
        log(f"kafka process {pid} exists but does not answer; waiting for it")
    else:
        log(f"starting kafka on 127.0.0.1:{KAFKA_PORT}")
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(
                java_cmd(lib, "kafka.Kafka", str(props), heap=KAFKA_HEAP),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (KAFKA_DIR / "kafka.pid").write_text(str(proc.pid))
    started = time.monotonic()
    while time.monotonic() - started < TIMEOUT:
        if kafka_metadata_ok():
            log(f"kafka ready in {time.monotonic() - started:.1f}s: bootstrap 127.0.0.1:{KAFKA_PORT}")
            return
        if kafka_pid() is None:
            break
        time.sleep(0.25)
    raise ServiceError(f"kafka did not answer a metadata request within {TIMEOUT:.0f}s; log tail:\n{tail(logfile)}")


def kafka_down() -> None:
    pid = kafka_pid()
    if pid is None:
        return
    log("stopping kafka")
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and kafka_pid() is not None:
        time.sleep(0.2)
    if kafka_pid() is not None:
        os.kill(pid, signal.SIGKILL)
    (KAFKA_DIR / "kafka.pid").unlink(missing_ok=True)


# ---------------------------------------------------------------- entry point


def status() -> int:
    bindir = None
    try:
        bindir = pg_bindir() if glob.glob("/usr/lib/postgresql/*/bin/initdb") else None
    except ServiceError:
        pass
    pg = bool(bindir) and pg_ready(bindir)
    kafka = kafka_metadata_ok()
    print(f"postgres: {'up ' + pg_dsn() if pg else 'down'}")
    print(f"kafka:    {'up 127.0.0.1:' + str(KAFKA_PORT) if kafka else 'down'}")
    # Not part of the exit status: callers (the demo) read it as "Postgres and Kafka are up".
    print(f"pgbouncer: {'up ' + pgb_dsn() if pg and pgb_ready() else 'down'}")
    _, spark_line = spark_cluster.status()
    print(f"spark:    {spark_line}")
    print(f"state:    {STATE}")
    return 0 if pg and kafka else 3  # Spark is optional here: callers (the demo) test for Postgres + Kafka


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["up", "down", "status", "env", "fetch", "cluster"])
    ap.add_argument("cluster_action", nargs="?", help="with `cluster`: see deploy/local/cluster.py")
    ap.add_argument("node", nargs="?", type=int, help="with `cluster` broker and Postgres actions: the node")
    ap.add_argument("--only", choices=["postgres", "kafka", "pgbouncer", "spark"])
    args = ap.parse_args(argv)
    if args.action == "cluster":
        import cluster  # deploy/local/cluster.py (imports this module: loaded only when asked for)

        if args.cluster_action not in cluster.ACTIONS:
            ap.error(f"cluster needs one of {', '.join(cluster.ACTIONS)}, got {args.cluster_action!r}")
        try:
            return cluster.main(args.cluster_action, args.node)
        except (cluster.base.ServiceError, first_use.FirstUseError, subprocess.CalledProcessError) as exc:
            print(f"[services] error: {exc}", file=sys.stderr)
            return 1
    if args.cluster_action is not None:
        ap.error(f"unexpected argument {args.cluster_action!r}")
    if args.action == "fetch":  # downloads only, nothing started: safe beside a running `up`
        try:
            print(f"KAFKA_LIB={kafka_jars()}")
        except (ServiceError, first_use.FirstUseError) as exc:
            print(f"[services] error: {exc}", file=sys.stderr)
            return 1
        return 0
    STATE.mkdir(parents=True, exist_ok=True)
    lock = open(STATE / "services.lock", "w")
    # Parallel test workers may all ask for `up` at once; one at a time does the work.
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        if args.action == "up":
            if args.only in (None, "postgres"):
                pg_up()
            if args.only in (None, "kafka"):
                kafka_up()
            if args.only in (None, "pgbouncer"):
                pgbouncer_up()
            spark_env = {}
            if args.only == "spark" or (args.only is None and spark_cluster.enabled()):
                if args.only is None and spark_cluster.spark_home() is None:
                    log("spark: skipped, pyspark is not installed yet (make venv)")
                else:
                    spark_env = spark_cluster.up(STATE)
            print(f"OUTBOX_TEST_DSN={pg_dsn()}")
            print(f"KAFKA_BOOTSTRAP=127.0.0.1:{KAFKA_PORT}")
            print(f"PGBOUNCER_DSN={pgb_dsn()}")
            print("".join(f"{k}={v}\n" for k, v in spark_env.items()), end="")
        elif args.action == "down":
            if args.only == "spark" or (args.only is None and spark_cluster.enabled()):
                spark_cluster.down(STATE)
            if args.only in (None, "pgbouncer"):
                pgbouncer_down()
            if args.only in (None, "kafka"):
                kafka_down()
            if args.only in (None, "postgres"):
                pg_down()
        elif args.action == "env":
            print(f"export OUTBOX_TEST_DSN={pg_dsn()}")
            print(f"export KAFKA_BOOTSTRAP=127.0.0.1:{KAFKA_PORT}")
            print(f"export PGBOUNCER_DSN={pgb_dsn()}")
        else:
            return status()
    except (
        ServiceError,
        first_use.FirstUseError,
        spark_cluster.SparkClusterError,
        subprocess.CalledProcessError,
    ) as exc:
        print(f"[services] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
