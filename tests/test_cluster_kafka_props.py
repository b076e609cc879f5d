"""The local cluster's broker settings (deploy/local/cluster_kafka.py): OUTBOX_CLUSTER_KAFKA_PROPS
adds settings after the defaults, so that Kafka, which keeps a key's last value, uses them."""

from __future__ import annotations

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
