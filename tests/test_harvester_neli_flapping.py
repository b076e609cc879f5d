"""A fenced leader resumes only on heartbeats that come back steadily, not on the first one.

Each resumption takes a new leader id (marking from the head of the outbox: everything in flight
is published again) and each fence retires the data producer (purging what it had in flight). A
heartbeat path that flaps (a broker failing over under load, a route that comes and goes) used to
resume the leader at the first heartbeat back, and fence it again as soon as that heartbeat's
validity ran out: several mark/fence cycles, each republishing the records in flight.

Real Kafka; the heartbeat producer alone goes through a proxy that can swallow its traffic, so
the group membership (the leader consumer) is untouched and only the heartbeat path flaps.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from confluent_kafka import Producer
from support.faults import HeldHeartbeats
from support.harness import heartbeats_flowing, wait_until
from support.tcp_proxy import KafkaProxy

from harvester.election.neli import FENCED, LEADER, Neli
from harvester.metrics import get as get_metrics

HB_TIMEOUT = 1.0
STEADY = 1.0  # resume_steady given to the election under test


class _States:
    def __init__(self, neli: Neli) -> None:
        self._lock = threading.Lock()
        self.changes: list[str] = []
        neli.lease(0).on_change = lambda state, _lid: self._add(state)

    def _add(self, state: str) -> None:
        with self._lock:
            self.changes.append(state)

    def count(self, state: str) -> int:
        with self._lock:
            return self.changes.count(state)


def _neli(bootstrap: str, topic: str, producer: dict, make_producer=Producer) -> Neli:
    return Neli(
        bootstrap=bootstrap,
        client={},
        consumer={},
        producer=producer,
        topic=topic,
        group=f"g-{uuid.uuid4().hex[:8]}",
        min_poll_interval=0.1,
        heartbeat_timeout=HB_TIMEOUT,
        session_timeout=20.0,  # the group stays put: only the heartbeat path flaps
        resume_steady=STEADY,
        metrics=get_metrics(),
        make_producer=make_producer,
    )


@pytest.fixture
def flapping(kafka_bootstrap, topics):
    proxy = KafkaProxy(kafka_bootstrap)
    n = _neli(kafka_bootstrap, topics("leader"), {"bootstrap.servers": proxy.address})
    states = _States(n)
    n.start()
    try:
        assert wait_until(lambda: n.state == LEADER, 30)
        time.sleep(1)
        assert heartbeats_flowing(n)  # through the proxy
        yield proxy, n, states
    finally:
        n.stop()
        proxy.close()


def test_a_heartbeat_path_that_reopens_briefly_between_outages_fences_once(flapping):
    proxy, n, states = flapping
    for _ in range(3):
        proxy.swallow()
        time.sleep(2 * HB_TIMEOUT)  # fenced by now
        assert n.state == FENCED, states.changes
        proxy.heal()
        time.sleep(0.5 * STEADY)  # heartbeats come back, but not for long
    proxy.swallow()
    time.sleep(2 * HB_TIMEOUT)
    proxy.heal()
    # (the state is set before its change is reported: wait for the report too)
    assert wait_until(lambda: n.leader_id() is not None and states.count(LEADER) >= 2, 15), states.changes
    # one fence, one resumption (each resumption is a mark from the head): not one per reopening
    assert states.count(FENCED) == 1, states.changes
    assert states.count(LEADER) == 2, states.changes


def test_a_lone_late_heartbeat_does_not_resume_a_fenced_leader(kafka_bootstrap, topics):
    """One heartbeat of its own read back late (sent most of a timeout ago, e.g. queued in the
    producer while the partition's leader failed over) vouches for too little to lead on."""
    topic = topics("leader")
    heartbeats = HeldHeartbeats()
    n = _neli(kafka_bootstrap, topic, {}, make_producer=heartbeats)
    states = _States(n)
    n.start()
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    try:
        assert wait_until(lambda: n.state == LEADER, 30)
        heartbeats.hold(6.0)
        assert wait_until(lambda: n.state == FENCED, 3 * HB_TIMEOUT)
        p.produce(topic, value=b"%s:%d" % (n.instance, time.monotonic_ns() - int(0.6e9 * HB_TIMEOUT)), partition=0)
        p.flush(5)
        time.sleep(1.5 * HB_TIMEOUT)
        assert states.count(LEADER) == 1, f"resumed on one heartbeat sent 0.6 of a timeout ago: {states.changes}"
        assert states.count(FENCED) == 1, states.changes
        assert wait_until(lambda: n.leader_id() is not None, 15), "heartbeats came back: never resumed"
    finally:
        n.stop()
