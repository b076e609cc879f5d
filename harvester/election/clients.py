"""The settings of the election's own Kafka clients: the leader consumer and the heartbeat producer.

Both start from `waits` (the bootstrap servers, harvester.election.timeouts' bounds on a silent
broker, then kafka.client), then the kafka.consumer or kafka.producer section, then what the
election needs whatever the configuration says.
"""

from __future__ import annotations

from harvester import logs


def leader_consumer_conf(waits: dict, consumer: dict, group: str, session_timeout: float) -> dict:
    return {
        # Rejoin within about a second after a broker restart (librdkafka's default back-off
        # grows to 10 s between connection attempts); configuration may still override it.
        **waits,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 1000,
        **consumer,
        "group.id": group,
        "session.timeout.ms": int(session_timeout * 1000),
        # A member learns of a rebalance (the leader left) on its next group heartbeat: keep
        # them frequent so a SIGTERM handover is not delayed by up to session/10.
        "heartbeat.interval.ms": max(100, min(250, int(session_timeout * 1000) // 3)),
        "partition.assignment.strategy": "cooperative-sticky",
        "enable.auto.commit": False,
        "auto.offset.reset": "latest",
        "log_level": 4,
        "logger": logs.KafkaLogger("leader-consumer"),
    }


def heartbeat_producer_conf(waits: dict, producer: dict, session_timeout: float) -> dict:
    """The heartbeat producer is the election's own (never the data path's): its own connection
    and timeouts. A heartbeat vouches only for the time it was sent, so one answered late costs
    nothing, while a request that times out tears the connection down and sends its heartbeats
    again behind a reconnect: its requests may wait up to the session timeout."""
    wait_ms = max(1000, int(session_timeout * 1000))
    return {
        **waits,
        **producer,
        "linger.ms": 0,
        "acks": 1,
        "enable.idempotence": False,
        "message.timeout.ms": wait_ms,
        "request.timeout.ms": wait_ms,
        "socket.nagle.disable": True,  # a heartbeat is one tiny request: never held for an ACK
        "log_level": 4,
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 1000,
        "logger": logs.KafkaLogger("heartbeat-producer"),
    }
