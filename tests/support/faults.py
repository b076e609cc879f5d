"""Fault injection for tests: a producer and an outbox store that fail at given rates.

Not part of the product: no module under harvester/ imports this one. Tests build a FaultPlan and
hand its `providers()` to the Harvester (harvester.publishing.ports.Providers); a reaper subprocess with faults
is started through tests/support/faulty_reaper.py, which reads the plan from REAPER_FAULT_INJECTION
(JSON) and runs `reaper run` with those providers. Two delivery failure kinds model what the real
idempotent producer can do under reaper's settings (infinite message timeout, gapless guarantee):
an *ambiguous* failure (the record was written, the report says it failed) and a *fatal* one (the
record was not written and the producer fails everything after it until it is replaced).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException, Producer

from harvester.publishing.ports import Providers

ENV_VAR = "REAPER_FAULT_INJECTION"


@dataclass
class FaultPlan:
    produce_error_rate: float = 0.0  # produce() raises KafkaException: nothing enqueued
    queue_full_rate: float = 0.0  # produce() raises BufferError (local queue limit exceeded)
    delivery_error_rate: float = 0.0  # record written, but its report says it failed
    delivery_fatal_rate: float = 0.0  # record not written; producer fails every later record until replaced
    mark_error_rate: float = 0.0  # the mark query raises (before it runs)
    mark_delay: float = 0.0  # seconds added to a mark ...
    mark_delay_rate: float = 0.0  # ... at this rate (drives deadline overruns)
    purge_error_rate: float = 0.0  # the purge raises (after it ran: rows gone, caller told it failed)
    reset_error_rate: float = 0.0  # the reset raises (before it ran)
    seed: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_rate") and not 0.0 <= v <= 1.0:
                raise ValueError(f"fault plan {f.name}={v!r}: a rate is between 0 and 1")
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()

    def roll(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if not k.startswith("_")})

    @classmethod
    def from_json(cls, text: str) -> FaultPlan:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{ENV_VAR}: unknown fault keys {sorted(unknown)}")
        return cls(**data)

    def providers(self) -> Providers:
        """Producers and a store that fail at this plan's rates."""
        return Providers(
            producer=lambda conf: FaultyProducer(Producer(conf), self),
            store=lambda store: FaultyStore(store, self),
            description=self.to_json(),
        )


def injected_error(what: str, fatal: bool = False) -> KafkaError:
    return KafkaError(KafkaError._FAIL, f"injected {what} fault", fatal=fatal)


class FaultyProducer:
    """Wraps confluent_kafka.Producer; fails produce() calls and delivery reports at the plan's rates."""

    def __init__(self, producer: Any, plan: FaultPlan) -> None:
        self._producer, self._plan = producer, plan
        self._pending: list[tuple[Callable, KafkaError]] = []
        self._lock = threading.Lock()
        self._broken = False

    def produce(
        self, topic, value=None, key=None, partition=-1, callback=None, on_delivery=None, timestamp=0, headers=None
    ):
        on_delivery = callback or on_delivery  # confluent-kafka's aliases
        plan = self._plan
        if plan.roll(plan.queue_full_rate):
            raise BufferError("injected fault: local queue full")
        if plan.roll(plan.produce_error_rate):
            raise KafkaException(injected_error("produce"))
        if self._broken or plan.roll(plan.delivery_fatal_rate):
            self._broken = True  # like a fatal idempotence error: nothing after this is written
            with self._lock:
                self._pending.append((on_delivery, injected_error("delivery (fatal)", fatal=True)))
            return
        if on_delivery is not None and plan.roll(plan.delivery_error_rate):
            inner = on_delivery

            def on_delivery(err, msg, _inner=inner):  # written, yet reported as failed
                _inner(injected_error("delivery (ambiguous)"), msg)

        self._producer.produce(
            topic,
            value=value,
            key=key,
            partition=partition,
            on_delivery=on_delivery,
            timestamp=timestamp,
            headers=headers,
        )

    def _serve_pending(self) -> int:
        with self._lock:
            pending, self._pending = self._pending, []
        for cb, err in pending:
            if cb is not None:
                cb(err, None)
        return len(pending)

    def poll(self, timeout: float = 0) -> int:
        return self._serve_pending() + self._producer.poll(timeout)

    def flush(self, timeout: float = -1) -> int:
        self._serve_pending()
        return self._producer.flush(timeout) if timeout >= 0 else self._producer.flush()

    def purge(self, *args, **kw) -> None:
        self._producer.purge(*args, **kw)

    def __getattr__(self, name: str) -> Any:  # init/begin/commit/abort_transaction pass straight through
        return getattr(self._producer, name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._producer)


class FaultyStore:
    """Wraps harvester.publishing.outbox_sql.OutboxStore; its mark, purge and reset fail at the plan's rates."""

    def __init__(self, store: Any, plan: FaultPlan) -> None:
        self._store, self._plan = store, plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def mark(self, leader_id, limit, *args, **kw):
        if self._plan.roll(self._plan.mark_delay_rate):
            time.sleep(self._plan.mark_delay)
        if self._plan.roll(self._plan.mark_error_rate):
            raise psycopg.OperationalError("injected mark fault")
        return self._store.mark(leader_id, limit, *args, **kw)

    def purge(self, leader_id, ids):
        n = self._store.purge(leader_id, ids)
        if self._plan.roll(self._plan.purge_error_rate):
            raise psycopg.OperationalError("injected purge fault")
        return n

    def reset(self, leader_id, ids):
        if self._plan.roll(self._plan.reset_error_rate):
            raise psycopg.OperationalError("injected reset fault")
        return self._store.reset(leader_id, ids)


class HeldHeartbeats:
    """A heartbeat producer factory for the leader election (Neli's `make_producer`,
    Providers.heartbeat_producer) whose heartbeats can be held back for a while, as if the leader
    topic were unreachable: `hold(seconds)`, and produce() sends nothing until then."""

    def __init__(self) -> None:
        self.until = 0.0

    def hold(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def __call__(self, conf: dict) -> _HeldProducer:
        return _HeldProducer(Producer(conf), self)

    def providers(self) -> Providers:
        return Providers(heartbeat_producer=self, description="heartbeats can be held back")


class _HeldProducer:
    def __init__(self, inner: Producer, held: HeldHeartbeats) -> None:
        self._inner, self._held = inner, held

    def produce(self, *args: Any, **kwargs: Any) -> None:
        if time.monotonic() >= self._held.until:
            self._inner.produce(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
