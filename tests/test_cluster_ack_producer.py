"""An application's AckProducer on the three-broker cluster (replication factor 3, min ISR 2)
when the broker leading its ack partitions stops answering.

Shares the cluster with the fault tests (one worker: xdist_group); the broker is resumed after.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer
from support.cluster import QUIET, Cluster, ClusterTopics

from tracker.consumer import AckDeliveryError, AckProducer
from tracker.kafka_waits import SILENT_BROKER_WAIT_MS

PARTITIONS = 3
# The local cluster's broker.session.timeout.ms: Kafka moves a silent broker's leaderships after it.
BROKER_SESSION_S = 4.0
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]


@pytest.fixture
def topics(cluster: Cluster) -> Iterator[ClusterTopics]:
    made = ClusterTopics(cluster.bootstrap)
    try:
        yield made
    finally:
        made.delete_all()


def _read_back(bootstrap: str, topic: str, want: dict[bytes, bytes]) -> dict[bytes, tuple[bytes, int]]:
    """The ack topic's records of the keys in `want`: key -> (value, partition)."""
    reader = Consumer(
        {**QUIET, "bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest"}
    )
    reader.subscribe([topic])
    got: dict[bytes, tuple[bytes, int]] = {}
    deadline = time.monotonic() + 60
    try:
        while set(want) - set(got) and time.monotonic() < deadline:
            for m in reader.consume(1000, timeout=0.5):
                key, value, partition = m.key(), m.value(), m.partition()
                if m.error() is None and key in want and value is not None and partition is not None:
                    got[key] = (value, partition)
    finally:
        reader.close()
    return got


def test_a_silent_broker_leading_the_ack_partitions_holds_flush_up_at_most_the_silent_wait(cluster, topics):
    """The broker leading ack-topic partitions stops answering (paused: connections stay open,
    nothing comes back) while an AckProducer holds acks for them. At its defaults, flush() returns
    with every ack in the topic while that broker stays silent, within the 15 s after which a
    silent broker is given up (plus slack), not after librdkafka's 30-60 s request and socket
    timeouts."""
    topic = topics("acks", PARTITIONS)
    acks = AckProducer(bootstrap_servers=cluster.bootstrap, topic=topic, kafka_client=dict(QUIET))
    want: dict[bytes, bytes] = {}

    def ack(batches: range) -> None:
        for batch_id in batches:
            acks.ack(f"{batch_id}:0:0-7")
            want[str(batch_id).encode()] = f"{batch_id}:0:0-7".encode()

    ack(range(1, 31))
    acks.flush()  # connected to every partition's leader, with a producer id: a running application
    leaders = cluster.topic_leaders(topic)
    victim = max(set(leaders.values()), key=list(leaders.values()).count)
    silent = {p for p, b in leaders.items() if b == victim}
    paused_at = cluster.pause_broker(victim)
    assert paused_at is not None, f"broker {victim} was not running"
    try:
        ack(range(31, 91))
        bound = max(BROKER_SESSION_S, SILENT_BROKER_WAIT_MS / 1000) + 8.0
        started = time.monotonic()
        try:
            acks.flush(bound)
        except AckDeliveryError as exc:
            try:
                acks.flush(120)
                late = "returned after"
            except AckDeliveryError:
                late = "still not done after"
            pytest.fail(
                f"flush() did not return within {bound} s of broker {victim} (leading partitions "
                f"{sorted(silent)}) going silent: {exc}; {late} {time.monotonic() - started:.1f} s"
            )
        print(f"flush() returned {time.monotonic() - started:.1f} s after the pause")
    finally:
        cluster.resume_broker(victim)
    got = _read_back(cluster.bootstrap, topic, want)
    assert {k: v for k, (v, _p) in got.items()} == want, f"acks missing from the topic: {sorted(set(want) - set(got))}"
    late_on_silent = {p for k, (_v, p) in got.items() if int(k) > 30} & silent
    assert late_on_silent, f"no ack written after the pause went to broker {victim}'s partitions {sorted(silent)}"
