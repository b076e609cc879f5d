"""The local Apache Kafka (deploy/local/services.py `up --only kafka`): one KRaft node, broker and
controller in one JVM, from its jars on Maven Central (resolved once per machine by
`mvn dependency:copy-dependencies` on deploy/local/kafka/pom.xml); state under <state>/kafka. The
cluster's brokers (cluster_kafka.py) use its jars, its Java command line and its cluster ids.

Environment: OUTBOX_KAFKA_LIB_CACHE (Kafka's jars, <cache>/kafka-lib), OUTBOX_KAFKA_PORT (59092),
OUTBOX_KAFKA_CONTROLLER_PORT (59093), OUTBOX_KAFKA_HEAP (512m).
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import first_use  # deploy/local/first_use.py: downloads safe under concurrency and interruption
from services_base import HERE, STATE, TIMEOUT, ServiceError, ensure_debian_packages, log, owned_pid, run, tail

KAFKA_PORT = int(os.environ.get("OUTBOX_KAFKA_PORT", "59092"))
CONTROLLER_PORT = int(os.environ.get("OUTBOX_KAFKA_CONTROLLER_PORT", "59093"))
KAFKA_HEAP = os.environ.get("OUTBOX_KAFKA_HEAP", "512m")
KAFKA_DIR = STATE / "kafka"


def kafka_lib_cache() -> Path:
    """Kafka's jars, shared by every checkout on the machine (read at each call: tests move it)."""
    return Path(os.environ.get("OUTBOX_KAFKA_LIB_CACHE") or first_use.cache_root() / "kafka-lib")


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
    """This layout's broker, if its pid file names one (services_base.owned_pid)."""
    return owned_pid(KAFKA_DIR / "kafka.pid", "kafka.Kafka", str(KAFKA_DIR / "server.properties"))


def format_storage(lib: Path, data: Path, props_for: Callable[[Path], str], cluster_id: str) -> None:
    """KRaft storage formatted into a private folder and renamed to `data` once whole
    (first_use.populate): two `up`s at once, or one killed mid-format while another waits, never
    format it twice with two cluster ids or leave half a format. `props_for(folder)` is the node's
    server.properties with its log.dirs at `folder`. A folder an older version formatted in place
    is whole once it has meta.properties (the formatter writes it last)."""

    def build(folder: Path, pass_fds: tuple[int, ...]) -> None:
        props = folder / "format.properties"  # inside: a killed build's folder goes with it
        props.write_text(props_for(folder))
        try:
            r = run(
                java_cmd(lib, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
                check=False,
                capture_output=True,
                pass_fds=pass_fds,  # the lock is held until the formatter ends, even if this process is killed
            )
        finally:
            props.unlink(missing_ok=True)
        if r.returncode != 0:
            raise ServiceError(f"StorageTool format failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")

    first_use.populate(data, build, adopt=lambda d: (d / "meta.properties").is_file(), log=log)


def kafka_up() -> None:
    if kafka_metadata_ok():
        log(f"kafka already running on 127.0.0.1:{KAFKA_PORT}")
        return
    lib = kafka_jars()
    KAFKA_DIR.mkdir(parents=True, exist_ok=True)
    data, props, logfile = KAFKA_DIR / "data", KAFKA_DIR / "server.properties", KAFKA_DIR / "kafka.log"
    props.write_text(kafka_props(data))
    format_storage(lib, data, kafka_props, new_kafka_cluster_id())
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
