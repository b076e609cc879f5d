"""bench.cluster_quiet finds this checkout's cluster nodes only, and reads their CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.harness import wait_for

from bench import cluster_quiet


def _node(state: Path, n: int) -> subprocess.Popen:
    """A process whose command line reads as a Kafka node's of the cluster in `state`; it burns CPU."""
    props = state / "cluster" / "kafka-dedicated" / f"node{n}" / "server.properties"
    burn = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end: pass"
    node = subprocess.Popen([sys.executable, "-c", burn, "kafka.Kafka", str(props)])
    # Popen returns once forked: until the child has exec'd, /proc shows the parent's command line.
    wait_for(lambda: b"kafka.Kafka" in Path(f"/proc/{node.pid}/cmdline").read_bytes(), 30, "the node's exec")
    return node


def test_only_the_nodes_of_this_state_folder_are_counted(tmp_path: Path) -> None:
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    nodes = [_node(mine, 1), _node(theirs, 1)]
    try:
        assert cluster_quiet.cluster_jvms(mine) == [nodes[0].pid]
        assert cluster_quiet.cluster_jvms(theirs) == [nodes[1].pid]
        assert cluster_quiet.cluster_jvms(tmp_path / "nobody") == []
    finally:
        for node in nodes:
            node.kill()
            node.wait()


def test_cores_reads_a_busy_node_and_refuses_to_read_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_quiet, "STATE", tmp_path)
    with pytest.raises(cluster_quiet.NoNodes):
        cluster_quiet.cores(0.1)
    node = _node(tmp_path, 1)
    try:
        assert cluster_quiet.cores(2.0) > 0.05  # a busy loop: a good part of a core, never 0
    finally:
        node.kill()
        node.wait()
