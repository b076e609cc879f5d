"""How long the election's Kafka clients wait on a broker that stops answering.

A broker that keeps its connections open but never answers (a paused process, a route that drops
packets) is given up by librdkafka only when a request to it times out: `socket.timeout.ms`
(default 60 s) for the consumer's fetches and group requests and every client's metadata
requests, `socket.connection.setup.timeout.ms` (default 30 s) for a new connection's handshake.
Until then the leader topic's consumer keeps fetching from, and asks its coordinator on, the
silent broker, long after Kafka moved its leaderships (after the brokers' session timeout); the
lease stays fenced meanwhile, and publishing with it.

The election bounds those waits by the group's session timeout: past it the group has moved the
lease on anyway, so waiting longer on that connection wins nothing, while giving it up sends the
requests again on a fresh connection, to whichever broker the metadata names by then. (Bounding
them by heartbeat_timeout gave up connections to brokers that were only slow under load, failing
every request in flight on them, and fenced lanes for nothing.) Metadata is refreshed every half
heartbeat_timeout (at most every second): a new partition leader is found without waiting for the
old one to time out. The data producer waits as long on a silent partition leader
(harvester.publishing.publisher: its requests are idempotent, a timed-out one is sent again to the
new leader), and so do the ackers' consumers and dead-letter producers (harvester.services.acker:
a fetch, an offset commit or a dead letter waiting on a silent broker stalls the acks of its
partitions, or the whole acker, for as long; the acks are applied again once it is given up and
the partition is fetched from its new leader). kafka.client, kafka.consumer and kafka.producer
settings override all of these.
"""

from __future__ import annotations


def silent_broker_wait_ms(heartbeat_timeout: float, session_timeout: float) -> int:
    """Milliseconds an election client waits on an unanswered request or connection: the session
    timeout. (Bounding it by heartbeat_timeout gave up connections to brokers that were only slow
    under load, each time failing every request in flight on them, and fenced lanes for nothing.)"""
    return max(1000, int(max(heartbeat_timeout, session_timeout) * 1000))


def election_client_defaults(heartbeat_timeout: float, session_timeout: float) -> dict[str, int]:
    """librdkafka defaults of the leader consumer and the heartbeat producer (configuration may override)."""
    return {
        **silent_broker_defaults(silent_broker_wait_ms(heartbeat_timeout, session_timeout)),
        # a moved leader topic partition is learned within half a heartbeat budget
        "topic.metadata.refresh.interval.ms": max(100, min(1000, int(heartbeat_timeout * 500))),
    }


def silent_broker_defaults(wait_ms: int, *, producer: bool = False) -> dict[str, int]:
    """librdkafka defaults of the reaper's long-lived data and ack clients (the data producer, the
    ackers' consumers and dead-letter producers): requests and new connections wait `wait_ms` on a
    broker that does not answer (silent_broker_wait_ms), and metadata is refreshed every half of it,
    at most every second, so a moved partition leader is learned without waiting for the old one to
    time out (a broker that is gone, not only silent, leaves nothing in flight to time out). With
    `producer`, the produce requests' own timeout too (a consumer has none). Configuration may
    override them all."""
    defaults = {**socket_waits(wait_ms), "topic.metadata.refresh.interval.ms": max(100, min(1000, wait_ms // 2))}
    if producer:
        defaults["request.timeout.ms"] = wait_ms
    return defaults


def socket_waits(wait_ms: int) -> dict[str, int]:
    """An unanswered request (of any kind) and a new connection's handshake wait `wait_ms`: what
    every client that talks to a silent broker needs (the reaper's readiness client takes only these)."""
    return {"socket.timeout.ms": wait_ms, "socket.connection.setup.timeout.ms": wait_ms}
