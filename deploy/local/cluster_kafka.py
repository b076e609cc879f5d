"""The local cluster's Kafka side (deploy/local/cluster.py): three KRaft nodes, each broker and
controller in one JVM, started, signalled and watched. Topics get replication factor 3 and
min.insync.replicas 2 by default; a lost broker is fenced within about 2 s. Heap per broker:
OUTBOX_CLUSTER_KAFKA_HEAP (384m); JVM flags: OUTBOX_CLUSTER_KAFKA_JVM_OPTS (the client JIT only).
OUTBOX_CLUSTER_KAFKA_PROPS ("key=value;key=value") adds broker settings over these, applied as
each broker starts. State under <state>/cluster/kafka<N>.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import services as base  # deploy/local/services.py: Kafka jars, Java
from cluster_layout import DIR, broker_port, controller_port

HEAP = os.environ.get("OUTBOX_CLUSTER_KAFKA_HEAP", "384m")
# written after (so over) the settings below: to try one on the cluster without editing this file
EXTRA = os.environ.get("OUTBOX_CLUSTER_KAFKA_PROPS", "")
# The client JIT only: a broker the fault tests restart answers sooner (about 4.6 s instead of
# 6.1 s on an idle 2-core machine, and the C2 compiler's CPU is spared the rest of a loaded run),
# and the cluster's traffic is far below what C1-compiled code carries. A throughput benchmark
# against the single-node Kafka (which keeps the full JIT) sets OUTBOX_CLUSTER_KAFKA_JVM_OPTS="".
JVM_OPTS = tuple(os.environ.get("OUTBOX_CLUSTER_KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1").split())
NODES = (1, 2, 3)


def bootstrap() -> str:
    return ",".join(f"127.0.0.1:{broker_port(n)}" for n in NODES)


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
""" + "".join(f"{item.strip()}\n" for item in EXTRA.split(";") if item.strip())


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
                base.java_cmd(lib, "kafka.Kafka", str(props), heap=HEAP, jvm_opts=JVM_OPTS),
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
