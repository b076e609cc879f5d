"""NELI leader election against the real Kafka: acquisition, fencing, resumption, handover."""

from __future__ import annotations

import time
import uuid

import pytest
from support.faults import HeldHeartbeats
from support.harness import wait_until

from harvester.election.neli import FENCED, FOLLOWER, LEADER, Neli
from harvester.metrics import get as get_metrics


def _neli(
    bootstrap: str,
    topic: str,
    group: str,
    changes: list | None = None,
    cls: type[Neli] = Neli,
    heartbeats: HeldHeartbeats | None = None,
    heartbeat_timeout: float = 1.0,
) -> Neli:
    return cls(
        bootstrap=bootstrap,
        client={},
        consumer={},
        producer={},
        topic=topic,
        group=group,
        min_poll_interval=0.1,
        heartbeat_timeout=heartbeat_timeout,
        session_timeout=3.0,
        metrics=get_metrics(),
        on_change=(lambda s, lid: changes.append((s, lid))) if changes is not None else (lambda s, lid: None),
        make_producer=heartbeats or HeldHeartbeats(),
    )


def test_fences_without_heartbeats_and_resumes_with_a_fresh_leader_id(kafka_bootstrap, topics):
    topic, group = topics("leader"), f"g-{uuid.uuid4().hex[:8]}"
    changes: list = []
    heartbeats = HeldHeartbeats()
    # A 2 s timeout: "the leader stays leader" below must not fail on a heartbeat delayed by a
    # loaded machine (more test workers than cores), which a 1 s timeout leaves little room for.
    n = _neli(kafka_bootstrap, topic, group, changes, heartbeats=heartbeats, heartbeat_timeout=2.0).start()
    try:
        assert wait_until(lambda: n.leader_id() is not None, 30)
        first = n.leader_id()
        time.sleep(3.0)
        assert n.leader_id() == first, "heartbeats flowing: the leader stays leader with the same id"
        heartbeats.hold(4.5)
        assert wait_until(lambda: n.leader_id() is None, 5), "no heartbeat for longer than the timeout: still leading"
        assert wait_until(lambda: n.state == FENCED, 3)
        assert wait_until(lambda: n.leader_id() is not None, 10), "heartbeats came back: never resumed"
        second = n.leader_id()
        assert second != first
        states = [s for s, _ in changes]
        assert states[:3] == [LEADER, FENCED, LEADER], states
    finally:
        n.stop()
    assert n.state == FOLLOWER


def test_a_joining_member_does_not_take_leadership_and_takes_over_on_leave(kafka_bootstrap, topics):
    topic, group = topics("leader"), f"g-{uuid.uuid4().hex[:8]}"
    # A 2 s heartbeat timeout, as above: the leader must keep its id through the 4 s below.
    a = _neli(kafka_bootstrap, topic, group, heartbeat_timeout=2.0).start()
    b = None
    try:
        assert wait_until(lambda: a.leader_id() is not None, 30)
        a_id = a.leader_id()
        b = _neli(kafka_bootstrap, topic, group, heartbeat_timeout=2.0).start()
        time.sleep(4)  # b has joined and the group rebalanced
        assert a.leader_id() == a_id and b.leader_id() is None
        left = time.monotonic()
        a.stop()
        assert wait_until(lambda: b.leader_id() is not None, 15)
        print(f"handover after leave: {time.monotonic() - left:.2f}s")
        assert b.leader_id() != a_id
    finally:
        a.stop()
        if b is not None:
            b.stop()


def test_a_heartbeat_read_back_late_vouches_only_for_when_it_was_sent(kafka_bootstrap, topics):
    """A leader paused with its own heartbeats still unread (SIGSTOP, a frozen VM) reads them on
    resuming: they must not revive the leadership that expired meanwhile."""
    from confluent_kafka import Producer

    topic, group = topics("leader"), f"g-{uuid.uuid4().hex[:8]}"
    heartbeats = HeldHeartbeats()
    n = _neli(kafka_bootstrap, topic, group, heartbeats=heartbeats).start()
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    try:
        assert wait_until(lambda: n.leader_id() is not None, 30)
        heartbeats.hold(4.0)
        stale_until = time.monotonic() + 3.0
        while time.monotonic() < stale_until:  # its own heartbeats, sent 2 s ago, arriving only now
            p.produce(topic, value=b"%s:%d" % (n.instance, time.monotonic_ns() - 2_000_000_000), partition=0)
            p.flush(5)
            time.sleep(0.05)
        assert n.state == FENCED and n.leader_id() is None, "heartbeats sent 2 s ago kept a 1 s leadership alive"
        fresh = b"%s:%d" % (n.instance, time.monotonic_ns())
        p.produce(topic, value=fresh, partition=0)
        p.flush(5)
        # resumed once heartbeats are fresh and steady (resume_steady) after the hold ends: a few
        # seconds on a quiet machine, bounded generously for a loaded one
        assert wait_until(lambda: n.leader_id() is not None, 15), "a fresh heartbeat did not resume it"
    finally:
        n.stop()


class _WedgedFirst(Neli):
    """Its first leader consumer never reaches a broker: it stays out of the group for good, as
    librdkafka's consumer sometimes does after a broker restart
    (test_harvester_failover.py::test_kafka_broker_restart_mid_stream)."""

    made = 0

    def _new_consumer(self):
        self.made += 1
        if self.made > 1:
            return super()._new_consumer()
        conf, self._consumer_conf = self._consumer_conf, {**self._consumer_conf, "bootstrap.servers": "127.0.0.1:9"}
        try:
            return super()._new_consumer()  # subscribed as any other: only its broker is unreachable
        finally:
            self._consumer_conf = conf


def test_a_leader_consumer_out_of_the_group_is_replaced_and_a_standby_is_not(kafka_bootstrap, topics):
    topic, group = topics("leader"), f"g-{uuid.uuid4().hex[:8]}"
    b = _neli(kafka_bootstrap, topic, group).start()
    a = None
    try:
        assert wait_until(lambda: b.leader_id() is not None, 30)
        b_consumer = b._consumer
        a = _neli(kafka_bootstrap, topic, group, cls=_WedgedFirst).start()
        assert wait_until(lambda: a.made == 2, 3.0 * 3 + 5), "a consumer out of the group was never replaced"
        time.sleep(3.0 * 3)  # a standby in the group, longer than the replacement threshold
        assert a.made == 2, "a standby that is in the group was replaced"
        assert b._consumer is b_consumer and b.lease(0).holding, "the leader lost its consumer or its partition"
        assert not a.lease(0).holding
        b.stop()
        assert wait_until(lambda: a.leader_id() is not None, 15), "the replaced consumer never took over"
    finally:
        b.stop()
        if a is not None:
            a.stop()


def test_brokers_that_name_no_cluster_are_refused_at_start(kafka_bootstrap, topics):
    """harvester.publishing.ownership tells elections apart by the cluster id: reapers that could not read it
    would hold their own deployment's tables off, so a reaper without one does not start."""
    from confluent_kafka.admin import AdminClient

    from harvester.election.leader_topic import KafkaClusterUnknown, ensure_leader_topic

    topic = topics("leader", partitions=1)
    assert ensure_leader_topic(AdminClient({"bootstrap.servers": kafka_bootstrap}), topic)  # this cluster has one
    old = {"bootstrap.servers": kafka_bootstrap, "api.version.request": False, "broker.version.fallback": "0.9.0"}
    with pytest.raises(KafkaClusterUnknown, match="no cluster id"):
        ensure_leader_topic(AdminClient(old), topic, timeout=15)
