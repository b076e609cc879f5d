"""NELI leases of several units with a broker that answers late, through a per-test proxy.

A heartbeat vouches for the time it was sent once the broker has it: its acknowledgement is that
evidence, one trip through the broker's request queue; reading it back through the leader
consumer needs a second trip (the consumer's next fetch request) and, under load, doubled the
measured gap, so leaders fenced themselves while Kafka was merely slow. A broker slower than the
heartbeat timeout, or one that no longer answers, must still fence every unit.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from support.harness import wait_until
from support.tcp_proxy import KafkaProxy

from harvester.election.neli import FENCED, LEADER, Neli
from harvester.metrics import get as get_metrics

UNITS = 3
# 4 s, not less: a broker answering in 0.55 of it leaves 1.8 s for the proxy, the broker and the
# election's own thread, which a loaded machine (more workers than cores) needs
HB_TIMEOUT = 4.0


class _States:
    def __init__(self, neli: Neli) -> None:
        self._lock = threading.Lock()
        self.changes: list[tuple[int, str]] = []
        for lease in neli.leases:
            lease.on_change = lambda state, _lid, u=lease.unit: self._add(u, state)

    def _add(self, unit: int, state: str) -> None:
        with self._lock:
            self.changes.append((unit, state))

    def fences(self) -> int:
        with self._lock:
            return sum(1 for _, s in self.changes if s == FENCED)


@pytest.fixture
def proxied(kafka_bootstrap, topics):
    proxy = KafkaProxy(kafka_bootstrap)
    n = Neli(
        bootstrap=proxy.address,
        client={},
        consumer={},
        producer={},
        topic=topics("leader", partitions=UNITS),
        group=f"g-{uuid.uuid4().hex[:8]}",
        min_poll_interval=0.1,
        heartbeat_timeout=HB_TIMEOUT,
        session_timeout=20.0,
        metrics=get_metrics(),
        units=UNITS,
    )
    states = _States(n)
    n.start()
    try:
        assert wait_until(lambda: all(lease.state == LEADER for lease in n.leases), 30)
        time.sleep(1)  # heartbeats flowing: the slowness below meets an established connection
        yield proxy, n, states
    finally:
        n.stop()
        proxy.close()


def test_a_broker_answering_late_within_the_timeout_fences_no_unit(proxied):
    proxy, n, states = proxied
    proxy.slow(0.55 * HB_TIMEOUT)
    time.sleep(3 * HB_TIMEOUT)
    assert states.fences() == 0, states.changes
    assert all(lease.leader_id() is not None for lease in n.leases)


@pytest.mark.parametrize("fault", ["slower than the timeout", "no answer"])
def test_a_leader_that_cannot_heartbeat_in_time_still_fences_every_unit(proxied, fault):
    proxy, n, states = proxied
    if fault == "no answer":
        proxy.swallow()
    else:
        proxy.slow(1.6 * HB_TIMEOUT)
    assert wait_until(lambda: all(lease.leader_id() is None for lease in n.leases), 2 * HB_TIMEOUT + 1)
    assert wait_until(lambda: all(lease.state == FENCED for lease in n.leases), 3)
    proxy.heal()
    assert wait_until(lambda: all(lease.leader_id() is not None for lease in n.leases), 30), states.changes
