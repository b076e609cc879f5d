"""A local production-like topology: three Kafka brokers with a KRaft controller quorum of three
(dedicated controller nodes by default, one JVM each; OUTBOX_CLUSTER_KAFKA_CONTROLLERS=combined
makes each broker its own controller too) and a Postgres primary with a synchronous streaming
standby. For fault tests and benchmarks.

    python3 deploy/local/services.py cluster up|down|status|env
    python3 deploy/local/services.py cluster kill-broker|stop-broker|start-broker|pause-broker|resume-broker N
        # Kafka node N: brokers 1-3; dedicated controllers 4-6
    python3 deploy/local/services.py cluster controller        # node id of the active KRaft controller
    python3 deploy/local/services.py cluster pg-kill|pg-start N   # Postgres node 1 or 2
    python3 deploy/local/services.py cluster promote           # stop the primary (if up), promote the standby
    python3 deploy/local/services.py cluster rejoin            # the old primary follows the new one

Ports (private, apart from the single-node services; OUTBOX_CLUSTER_PORT_BASE, default 25400):
Postgres nodes base+1, base+2; Kafka brokers base+11..13, the controllers' listeners base+21..23.
Topics get replication factor 3 and min.insync.replicas 2 by default. The Postgres primary waits
for the standby's flush at each commit (synchronous_standby_names), so a promotion loses nothing
committed; a promoted standby writes alone (no standby to wait for) until the old primary rejoins.
Kafka's heap per broker: OUTBOX_CLUSTER_KAFKA_HEAP (384m); more Kafka settings:
OUTBOX_CLUSTER_KAFKA_PROPS ("key=value;key=value", over the defaults). State under <state>/cluster.

This module is the command line and what spans both sides (up, down, status, the environment
lines); the brokers are cluster_kafka.py, the Postgres primary and standby cluster_postgres.py, the
ports and state folder cluster_layout.py, all beside it.
"""

from __future__ import annotations

import fcntl
import signal

import services as base  # deploy/local/services.py: ServiceError (services.py reads it as cluster.base)
from cluster_kafka import (
    BROKERS,
    CONTROLLERS,
    NODES,
    active_controller,
    bootstrap,
    broker_pid,
    broker_signal,
    broker_start,
    kafka_dir,
    quorum_port,
    roles,
    stop_strays,
    stop_together,
    wait_brokers,
)
from cluster_layout import DIR, broker_port, pg_port
from cluster_postgres import (
    PG_NODES,
    dsn,
    in_recovery,
    node_dsn,
    pg_data,
    pg_kill,
    pg_start,
    pg_stop,
    pg_up,
    promote,
    rejoin,
)


def env_lines() -> list[str]:
    return [f"CLUSTER_PG_DSN={dsn()}", f"CLUSTER_KAFKA_BOOTSTRAP={bootstrap()}"] + [
        f"CLUSTER_PG_NODE{n}={node_dsn(n)}" for n in PG_NODES
    ]


# ---------------------------------------------------------------- entry point


def up() -> None:
    DIR.mkdir(parents=True, exist_ok=True)
    pg_up()
    stop_strays()
    for n in NODES:
        broker_signal(n, signal.SIGCONT)  # one left paused by a test
        broker_start(n, wait=False)
    wait_brokers(NODES)


def _stop_at_once(nodes: tuple[int, ...]) -> None:
    stop_together([kafka_dir(n) / "kafka.pid" for n in nodes])


def down() -> None:
    # The brokers at once, then the dedicated controllers: stopped one after the other, the last
    # broker waits out its whole 30 s for a controller quorum already gone (a broker shuts down
    # through the active controller; a combined node stops its broker before its controller, so
    # stopped together every broker finds a quorum to shut down with).
    _stop_at_once(BROKERS)
    _stop_at_once(tuple(n for n in CONTROLLERS if n not in BROKERS))
    stop_strays()
    for n in PG_NODES:
        if (pg_data(n) / "PG_VERSION").exists():
            pg_stop(n, "fast")


def status() -> int:
    ok = True
    for n in NODES:
        broker = n in BROKERS
        alive = broker_pid(n) is not None and (
            base.kafka_metadata_ok(broker_port(n)) if broker else base.port_open(quorum_port(n))
        )
        ok &= alive
        port = broker_port(n) if broker else quorum_port(n)
        print(f"kafka node {n} ({roles(n)}): {'up' if alive else 'down'} 127.0.0.1:{port}")
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
