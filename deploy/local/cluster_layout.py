"""Where the local cluster (deploy/local/cluster.py) lives: its ports and its state folder.

Ports (private, apart from the single-node services; OUTBOX_CLUSTER_PORT_BASE, default 25400):
Postgres nodes base+1, base+2; Kafka brokers base+11..13, the KRaft controllers' listeners base+21..23.
"""

from __future__ import annotations

import os

import services as base  # deploy/local/services.py: the state folder

PORT_BASE = int(os.environ.get("OUTBOX_CLUSTER_PORT_BASE", "25400"))
DIR = base.STATE / "cluster"


def pg_port(n: int) -> int:
    return PORT_BASE + n


def broker_port(n: int) -> int:
    return PORT_BASE + 10 + n


def controller_port(n: int) -> int:
    return PORT_BASE + 20 + n
