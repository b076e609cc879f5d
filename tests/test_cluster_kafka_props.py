"""The local cluster's broker settings (deploy/local/cluster_kafka.py): OUTBOX_CLUSTER_KAFKA_PROPS
adds settings after the defaults, so that Kafka, which keeps a key's last value, uses them."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

LOCAL = Path(__file__).resolve().parents[1] / "deploy" / "local"
sys.path.insert(0, str(LOCAL))
import cluster_kafka  # noqa: E402


def _last_values(props: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in props.splitlines():
        if line and not line.startswith("#"):
            key, value = line.split("=", 1)
            values[key] = value
    return values


def test_extra_settings_come_after_the_defaults_and_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_kafka, "EXTRA", " replica.fetch.backoff.ms=100 ; min.insync.replicas=1;")
    props = cluster_kafka.kafka_props(2)
    values = _last_values(props)
    assert values["replica.fetch.backoff.ms"] == "100"
    assert values["min.insync.replicas"] == "1"  # over the default 2
    assert props.index("min.insync.replicas=1") > props.index("min.insync.replicas=2")
    assert values["node.id"] == "2"


def test_without_extra_settings_the_defaults_stand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_kafka, "EXTRA", "")
    values = _last_values(cluster_kafka.kafka_props(1))
    assert values["min.insync.replicas"] == "2"
    assert "replica.fetch.backoff.ms" not in values


@pytest.fixture
def layout(monkeypatch: pytest.MonkeyPatch):
    """cluster_kafka as loaded with OUTBOX_CLUSTER_KAFKA_CONTROLLERS set to the given value."""

    def load(value: str | None):
        if value is None:
            monkeypatch.delenv("OUTBOX_CLUSTER_KAFKA_CONTROLLERS", raising=False)
        else:
            monkeypatch.setenv("OUTBOX_CLUSTER_KAFKA_CONTROLLERS", value)
        monkeypatch.setattr(importlib.reload(cluster_kafka), "EXTRA", "")
        return cluster_kafka

    yield load
    monkeypatch.delenv("OUTBOX_CLUSTER_KAFKA_CONTROLLERS", raising=False)
    importlib.reload(cluster_kafka)


def test_by_default_three_brokers_and_three_dedicated_controllers(layout) -> None:
    kafka = layout(None)
    assert kafka.BROKERS == (1, 2, 3) and kafka.CONTROLLERS == (4, 5, 6) and kafka.NODES == (1, 2, 3, 4, 5, 6)
    voters = {f"{n}@127.0.0.1:{kafka.controller_port(i)}" for i, n in enumerate((4, 5, 6), start=1)}
    for n in kafka.BROKERS:
        values = _last_values(kafka.kafka_props(n))
        assert values["process.roles"] == "broker"
        assert values["listeners"] == f"PLAINTEXT://127.0.0.1:{kafka.broker_port(n)}"
        assert values["advertised.listeners"] == values["listeners"]
        assert set(values["controller.quorum.voters"].split(",")) == voters
    ports = set()
    for n in kafka.CONTROLLERS:
        values = _last_values(kafka.kafka_props(n))
        assert values["process.roles"] == "controller"
        assert values["listeners"] == f"CONTROLLER://127.0.0.1:{kafka.quorum_port(n)}"
        assert "advertised.listeners" not in values  # no client listener to advertise
        assert set(values["controller.quorum.voters"].split(",")) == voters
        # the settings the controllers apply in KRaft are theirs too
        assert values["broker.session.timeout.ms"] == "2000" and values["default.replication.factor"] == "3"
        ports.add(kafka.quorum_port(n))
    assert len(ports) == 3 and not ports & {kafka.broker_port(n) for n in kafka.BROKERS}
    assert kafka.bootstrap().count(",") == 2  # clients know the brokers only


def test_combined_nodes_are_broker_and_controller_in_one(layout) -> None:
    kafka = layout(" Combined ")
    assert kafka.NODES == kafka.BROKERS == kafka.CONTROLLERS == (1, 2, 3)
    values = _last_values(kafka.kafka_props(2))
    assert values["process.roles"] == "broker,controller"
    assert values["listeners"] == (
        f"PLAINTEXT://127.0.0.1:{kafka.broker_port(2)},CONTROLLER://127.0.0.1:{kafka.controller_port(2)}"
    )
    # each layout keeps its own state: a node never starts on storage the other layout formatted
    assert kafka.kafka_dir(2) != layout("dedicated").kafka_dir(2)


def test_an_unknown_layout_is_refused_by_name(layout) -> None:
    with pytest.raises(cluster_kafka.base.ServiceError, match="'separate'"):
        layout("separate")


@pytest.mark.parametrize("controllers", ["dedicated", "combined"])
def test_down_stops_the_brokers_together_then_the_controllers(layout, monkeypatch, controllers) -> None:
    layout(controllers)
    import cluster  # after cluster_kafka is loaded with this layout

    cluster = importlib.reload(cluster)
    stopped: list[list[int]] = []
    monkeypatch.setattr(cluster, "_stop_at_once", lambda nodes: stopped.append(list(nodes)) or None)
    monkeypatch.setattr(cluster, "stop_strays", lambda: None)
    monkeypatch.setattr(cluster, "pg_stop", lambda n, mode: None)
    cluster.down()
    if controllers == "dedicated":
        assert stopped == [[1, 2, 3], [4, 5, 6]]
    else:
        assert stopped == [[1, 2, 3], []]
    # an empty group (a combined layout has no controller of its own) stops nothing and raises nothing
    monkeypatch.undo()
    layout(controllers)
    cluster = importlib.reload(cluster)
    signalled: list[int] = []
    monkeypatch.setattr(cluster_kafka, "_end", lambda pid, wait=0.0, sig=None: signalled.append(pid))
    cluster._stop_at_once(())
    assert signalled == []


@pytest.fixture
def taken_port():
    """A port some other process listens on (here: this test), as another checkout's node would."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_kafka_node_whose_port_another_process_holds_is_refused_by_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, taken_port: int
) -> None:
    """A second checkout's `cluster up` on the same ports would take the first one's nodes for its
    own (they answer) and start JVMs that cannot bind: it is refused, naming the port, before
    anything is downloaded or started."""
    monkeypatch.setattr(cluster_kafka, "broker_port", lambda n: taken_port)
    monkeypatch.setattr(cluster_kafka, "kafka_dir", lambda n: tmp_path / f"node{n}")
    monkeypatch.setattr(cluster_kafka.base, "kafka_jars", lambda: pytest.fail("jars fetched for a refused node"))
    with pytest.raises(cluster_kafka.base.ServiceError, match=rf"127\.0\.0\.1:{taken_port}, the port of kafka node 1"):
        cluster_kafka.broker_start(1)
    assert not (tmp_path / "node1").exists()


def test_a_postgres_node_whose_port_another_process_holds_is_refused_by_port(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, taken_port: int
) -> None:
    import cluster_postgres

    monkeypatch.setattr(cluster_postgres, "pg_port", lambda n: taken_port)
    monkeypatch.setattr(cluster_postgres, "pg_data", lambda n: tmp_path / f"pg{n}" / "data")
    monkeypatch.setattr(cluster_postgres, "_prepare_dirs", lambda n: None)
    monkeypatch.setattr(cluster_postgres, "pg_run", lambda *a, **k: pytest.fail("pg_ctl run for a refused node"))
    with pytest.raises(
        cluster_postgres.base.ServiceError, match=rf"127\.0\.0\.1:{taken_port}, the port of postgres node 2"
    ):
        cluster_postgres.pg_start(2)
