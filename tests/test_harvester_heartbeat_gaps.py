"""A leadership that lapses and comes back under the same NELI id must not skip rows.

Under load, the lease can read "overdue" (`leader_id()` is None) for a moment and then a late
heartbeat arrives before the NELI thread fences: the same acquisition goes on. The CI run of
2026-11-23 caught what that did: the producer thread dropped the batch it held (or stopped it
halfway) while the lease read overdue, those rows stayed marked by the leader id, and the marker,
back under the very same id, marked only rows *not* marked by it, so it published the keys' later
rows and left the dropped ones until the next leader change ("key-31: 105 first seen after 106").

Here the real `Lease` is driven by hand (no NELI thread: the gaps are the fault injected), on
real Postgres and Kafka, for many gaps of random length while rows flow.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

from support.harness import Generator, Receiver, make_config, order_violations, outbox_count, wait_until

from harvester.config import units
from harvester.election.lease import LEADER, Lease
from harvester.metrics import UnitMetrics
from harvester.metrics import get as get_metrics
from harvester.publishing.mark_purge_reset import UnitHarvester

HB_TIMEOUT = 1.0


class Heartbeats:
    """Keeps the lease fresh every 10 ms, except during the gaps asked for (same id throughout)."""

    def __init__(self, lease: Lease) -> None:
        self.lease, self.gaps = lease, 0
        self._gap_until = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            now = time.monotonic()
            if now < self._gap_until:
                self.lease.last_heartbeat = now - HB_TIMEOUT - 0.5  # overdue: leader_id() reads None
            else:
                self.lease.last_heartbeat = now

    def gap(self, seconds: float) -> None:
        self._gap_until = time.monotonic() + seconds
        self.gaps += 1

    def __enter__(self) -> Heartbeats:
        self.lease.last_heartbeat = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_a_lapse_that_comes_back_under_the_same_id_skips_no_row(pg_dsn, kafka_bootstrap, schema, topics):
    topic = topics("data", partitions=3)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"heartbeat_timeout": HB_TIMEOUT, "mark_batch": 40})
    spec = units(cfg)[0]
    metrics = UnitMetrics(get_metrics(cfg.metrics.prefix), spec.name)
    unit = UnitHarvester(cfg, spec, metrics=metrics)
    lease = Lease(spec.index, HB_TIMEOUT, metrics, on_change=lambda state, leader_id: None)
    receiver = Receiver(kafka_bootstrap, topic, 3)
    gen = Generator(pg_dsn, schema, topic, keys=20, per_txn=10)
    rng = random.Random(20261123)
    try:
        unit.start(lease)
        with Heartbeats(lease) as beats:
            lease.last_heartbeat = time.monotonic()
            lease.set(LEADER, uuid.uuid4())  # one acquisition for the whole test: never fenced
            gen.start(rate_per_s=2000)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(0.05, 0.4))
                beats.gap(rng.uniform(0.005, 0.12))
            gen.stop()
            assert beats.gaps >= 40
            missing = lambda: len(gen.committed - receiver.unique())  # noqa: E731
            assert receiver.wait_for(gen.committed, 60), f"{missing()} of {len(gen.committed)} never published"
            assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 30)
        assert order_violations([(k, v) for k, v, _ in receiver.records]) == []
    finally:
        unit.begin_stop()
        unit.finish(2)
        unit.close()
        receiver.close()
    assert unit.error is None, unit.error
