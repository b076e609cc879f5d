"""The local cluster's Kafka side (deploy/local/cluster.py): three brokers (nodes 1-3) and a KRaft
controller quorum of three, started, signalled and watched.

OUTBOX_CLUSTER_KAFKA_CONTROLLERS picks the controllers: `dedicated` (the default, as production
clusters run them: three more JVMs, nodes 4-6, so losing a broker never also loses the active
controller, whose election would come first and double the failover) or `combined` (each broker
node is also a controller, one JVM each: fewer processes, a longer failover when the lost broker
was the active controller). Topics get replication factor 3 and min.insync.replicas 2 by default;
a lost broker is fenced within about 2 s. Heap per broker: OUTBOX_CLUSTER_KAFKA_HEAP (384m), per
dedicated controller OUTBOX_CLUSTER_KAFKA_CONTROLLER_HEAP (256m); JVM flags:
OUTBOX_CLUSTER_KAFKA_JVM_OPTS (the client JIT only). OUTBOX_CLUSTER_KAFKA_PROPS
("key=value;key=value") adds settings over these, applied as each node starts. State under
<state>/cluster/kafka-<controllers>/node<N>.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import services as base  # deploy/local/services.py: Kafka jars, Java
from cluster_layout import DIR, broker_port, controller_port

HEAP = os.environ.get("OUTBOX_CLUSTER_KAFKA_HEAP", "384m")
CONTROLLER_HEAP = os.environ.get("OUTBOX_CLUSTER_KAFKA_CONTROLLER_HEAP", "256m")
# written after (so over) the settings below: to try one on the cluster without editing this file
EXTRA = os.environ.get("OUTBOX_CLUSTER_KAFKA_PROPS", "")
# The client JIT only: a broker the fault tests restart answers sooner (about 4.6 s instead of
# 6.1 s on an idle 2-core machine, and the C2 compiler's CPU is spared the rest of a loaded run),
# and the cluster's traffic is far below what C1-compiled code carries. A throughput benchmark
# against the single-node Kafka (which keeps the full JIT) sets OUTBOX_CLUSTER_KAFKA_JVM_OPTS="".
JVM_OPTS = tuple(os.environ.get("OUTBOX_CLUSTER_KAFKA_JVM_OPTS", "-XX:TieredStopAtLevel=1").split())
LAYOUTS = ("dedicated", "combined")
LAYOUT = os.environ.get("OUTBOX_CLUSTER_KAFKA_CONTROLLERS", "dedicated").strip().lower()
if LAYOUT not in LAYOUTS:
    raise base.ServiceError(
        f"OUTBOX_CLUSTER_KAFKA_CONTROLLERS must be one of {', '.join(LAYOUTS)}, got {os.environ['OUTBOX_CLUSTER_KAFKA_CONTROLLERS']!r}"
    )
BROKERS = (1, 2, 3)
CONTROLLERS = (4, 5, 6) if LAYOUT == "dedicated" else BROKERS
NODES = tuple(sorted(set(BROKERS) | set(CONTROLLERS)))  # every Kafka process of the layout


def bootstrap() -> str:
    return ",".join(f"127.0.0.1:{broker_port(n)}" for n in BROKERS)


def kafka_dir(n: int) -> Path:
    return DIR / f"kafka-{LAYOUT}" / f"node{n}"


def quorum_port(n: int) -> int:
    """Controller node n's listener: the controllers' ports in order, whatever their node ids."""
    return controller_port(CONTROLLERS.index(n) + 1)


def roles(n: int) -> str:
    return ",".join(role for role, nodes in (("broker", BROKERS), ("controller", CONTROLLERS)) if n in nodes)


def kafka_props(n: int, logdir: Path | None = None) -> str:
    voters = ",".join(f"{i}@127.0.0.1:{quorum_port(i)}" for i in CONTROLLERS)
    listeners = [f"PLAINTEXT://127.0.0.1:{broker_port(n)}"] if n in BROKERS else []
    listeners += [f"CONTROLLER://127.0.0.1:{quorum_port(n)}"] if n in CONTROLLERS else []
    advertised = f"advertised.listeners=PLAINTEXT://127.0.0.1:{broker_port(n)}\n" if n in BROKERS else ""
    # Every node gets every setting below: in KRaft the controllers apply some (topic defaults,
    # the brokers' session, unclean election), the brokers others.
    return f"""# written by deploy/local/cluster.py
process.roles={roles(n)}
node.id={n}
controller.quorum.voters={voters}
listeners={",".join(listeners)}
{advertised}controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs={logdir or kafka_dir(n) / "data"}
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
    """The pid of Kafka node n (a broker, a controller or both), None if it is not running."""
    return _kafka_pid(kafka_dir(n) / "kafka.pid")


def _kafka_pid(pid_file: Path) -> int | None:
    """The broker `pid_file` names, if it is the one of that node's folder (its server.properties
    beside the pid file): never another node's, another layout's or the single-node broker."""
    return base.owned_pid(pid_file, "kafka.Kafka", str(pid_file.parent / "server.properties"))


def stop_strays() -> None:
    """Stop Kafka nodes of another layout (or of this script's older one, <state>/cluster/kafka<N>)
    still running from an earlier `up`: they hold the ports this layout's nodes listen on."""
    ours = {kafka_dir(n) / "kafka.pid" for n in NODES}
    # a stale pid file (from before a reboot) may name a pid one of this layout's nodes has now
    ours_pids = {broker_pid(n) for n in NODES} - {None}
    brokers: list[tuple[int, Path]] = []
    controllers: list[tuple[int, Path]] = []
    for pid_file in [*DIR.glob("kafka*/kafka.pid"), *DIR.glob("kafka-*/node*/kafka.pid")]:
        pid = None if pid_file in ours else _kafka_pid(pid_file)
        if pid is not None and pid not in ours_pids:
            try:
                only_controller = "process.roles=controller\n" in (pid_file.parent / "server.properties").read_text()
            except OSError:
                only_controller = False
            (controllers if only_controller else brokers).append((pid, pid_file))
    # like `down`: the brokers together, then the controllers, so that none waits for a quorum gone
    for group in (brokers, controllers):
        for _pid, pid_file in group:
            base.log(f"cluster: stopping a Kafka node of another layout ({pid_file.parent})")
        stop_together([pid_file for _pid, pid_file in group])


def stop_together(pid_files: list[Path]) -> None:
    """SIGTERM the running Kafka nodes of `pid_files` at once and wait until each has ended
    (SIGKILL after 30 s). One after the other, the last broker would wait out its 30 s for a
    controller quorum its peers took away."""
    running = [(pid_file, pid) for pid_file in pid_files if (pid := _kafka_pid(pid_file)) is not None]
    if not running:
        return
    with ThreadPoolExecutor(len(running)) as pool:
        list(pool.map(lambda item: _end(item[1], wait=30), running))
    for pid_file, _pid in running:
        pid_file.unlink(missing_ok=True)


def broker_start(n: int, wait: bool = True) -> None:
    """Start Kafka node n (a broker, a controller or both) unless it runs; wait until it answers."""
    if broker_pid(n) is None:
        where = broker_port(n) if n in BROKERS else quorum_port(n)
        if base.port_open(where):
            raise base.ServiceError(base.port_taken(where, f"kafka node {n}", kafka_dir(n)))
        lib = base.kafka_jars()
        folder = kafka_dir(n)
        folder.mkdir(parents=True, exist_ok=True)
        props = folder / "server.properties"
        props.write_text(kafka_props(n))
        base.format_storage(lib, folder / "data", lambda logdir: kafka_props(n, logdir), cluster_id())
        base.log(f"cluster: starting kafka node {n} ({roles(n)}) on 127.0.0.1:{where}")
        with open(folder / "kafka.log", "ab") as out:
            proc = subprocess.Popen(
                base.java_cmd(
                    lib, "kafka.Kafka", str(props), heap=HEAP if n in BROKERS else CONTROLLER_HEAP, jvm_opts=JVM_OPTS
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        (folder / "kafka.pid").write_text(str(proc.pid))
    if wait:
        wait_brokers([n])


def _answers(n: int) -> bool:
    # a broker answers a client's metadata request (it has registered with the controllers); a
    # dedicated controller takes no client requests, so its listener accepting is what is checked
    return base.kafka_metadata_ok(broker_port(n)) if n in BROKERS else base.port_open(quorum_port(n))


def wait_brokers(nodes: list[int] | tuple[int, ...]) -> None:
    """Each of Kafka nodes `nodes` answers (see _answers)."""
    started = time.monotonic()
    pending = list(nodes)
    while pending and time.monotonic() - started < base.TIMEOUT * 2:
        pending = [n for n in pending if not _answers(n)]
        for n in pending:
            if broker_pid(n) is None:
                raise base.ServiceError(f"kafka node {n} exited; log tail:\n{base.tail(kafka_dir(n) / 'kafka.log')}")
        if pending:
            time.sleep(0.25)
    if pending:
        n = pending[0]
        raise base.ServiceError(f"kafka node {n} did not answer; log tail:\n{base.tail(kafka_dir(n) / 'kafka.log')}")


def broker_signal(n: int, sig: signal.Signals, wait: float = 0.0) -> float | None:
    """Signal Kafka node n; for SIGTERM/SIGKILL, wait until its process has ended. Returns when the
    signal was sent (time.monotonic(), the same clock in every process), None if it was not running."""
    pid = broker_pid(n)
    if pid is None:
        return None
    sent = _end(pid, wait, sig) if sig in (signal.SIGTERM, signal.SIGKILL) else _send(pid, sig)
    if sig in (signal.SIGTERM, signal.SIGKILL):
        (kafka_dir(n) / "kafka.pid").unlink(missing_ok=True)
    return sent


def _send(pid: int, sig: signal.Signals) -> float:
    os.kill(pid, sig)
    return time.monotonic()


def _end(pid: int, wait: float = 0.0, sig: signal.Signals = signal.SIGTERM) -> float:
    """Send SIGTERM or SIGKILL and wait until the process has ended (SIGKILL after `wait`, 60 s by
    default); returns when the first signal was sent."""
    sent = _send(pid, sig)
    if sig == signal.SIGTERM:
        os.kill(pid, signal.SIGCONT)  # a paused node cannot shut down
    deadline = time.monotonic() + (wait or 60)
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    return sent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, OSError, IndexError):
        return False
    return state != "Z"  # killed, not yet reaped: ended


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
        if leader in CONTROLLERS and (best is None or epoch > best[0]):
            best = (epoch, leader)
    return best[1] if best else None
