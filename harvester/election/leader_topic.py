"""The leader topic: one partition per harvest unit, created if missing, refused if it disagrees.

The election (harvester.election.neli) runs on it; the Kafka cluster's id read here tells one
election's outbox claims from another's (harvester.publishing.ownership).
"""

from __future__ import annotations

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic


class LeaderTopicMismatch(RuntimeError):
    """The leader topic's partition count differs from the configured number of harvest units."""


class KafkaClusterUnknown(RuntimeError):
    """The brokers did not say which cluster they are (harvester.publishing.ownership needs it to tell elections apart)."""


def ensure_leader_topic(admin: AdminClient, topic: str, timeout: float = 30.0, partitions: int = 1) -> str:
    """Create the leader topic, one partition per unit, if it is missing (brokers here do not
    auto-create). An existing topic with another partition count is refused: reapers that disagree
    on the units could lead overlapping lanes (see the running and scaling how-to: drain, then switch).
    Returns the Kafka cluster's id (one election per cluster); KafkaClusterUnknown without one."""
    md = admin.list_topics(topic=topic, timeout=timeout)
    cluster = md.cluster_id or ""
    if not cluster:
        # Reapers of one election that disagreed on the cluster would hold each other's tables off
        # (harvester.publishing.ownership): refuse rather than run as "unknown" beside others that know it.
        raise KafkaClusterUnknown(
            "the Kafka brokers' metadata names no cluster id (brokers before 0.10.1, or "
            "broker.version.fallback below 0.10.1 with api.version.request=false in kafka.client): the reaper needs it"
        )
    t = md.topics.get(topic)
    if t is not None and t.error is None:
        if len(t.partitions) != partitions:
            raise LeaderTopicMismatch(
                f"leader topic {topic!r} has {len(t.partitions)} partition(s) but {partitions} harvest unit(s) are "
                "configured: to change the units or lanes, stop every reaper, then start them with a new "
                "harvester.leader_topic and harvester.leader_group"
            )
        return cluster
    fut = admin.create_topics(
        [
            NewTopic(
                topic,
                num_partitions=partitions,
                replication_factor=-1,
                config={"retention.ms": "3600000", "cleanup.policy": "delete"},
            )
        ],
        operation_timeout=timeout,
    )[topic]
    try:
        fut.result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() != exc.args[0].TOPIC_ALREADY_EXISTS:
            raise
    return cluster
