"""The publisher: one producer slot, one settler and the publishing strategy of the configured mode.

- harvester.publishing.producer_slot.ProducerSlot: the current producer, retiring it, the one thread serving callbacks;
- harvester.publishing.deliveries.DeliverySettler: delivery reports settled in batches (purge, reset, quarantine), the
  throttle's in-flight count, the progress counters;
- harvester.publishing.idempotent.PlainStrategy or harvester.publishing.transactional.TransactionalStrategy (a
  `transactional.id` in the producer configuration): how marked rows reach Kafka.

Each module states its contract. This one wires them and guards the life cycle: a publisher is
started once, and never again after close().
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

from harvester.config import REQUIRED_PRODUCER
from harvester.election.timeouts import silent_broker_defaults
from harvester.metrics import MetricsLike
from harvester.publishing.deliveries import PERMANENT_DELIVERY, DeliverySettler, error_reason, logs_safe  # noqa: F401
from harvester.publishing.idempotent import (  # noqa: F401
    INTERNAL,
    PERMANENT_PRODUCE,
    RESERVED,
    Deadline,
    PlainStrategy,
    QuarantineError,
    Valid,
)
from harvester.publishing.ports import DEFAULT, Providers, StoreLike
from harvester.publishing.producer_slot import ProducerSlot
from harvester.publishing.topic_limits import TopicLimits
from harvester.publishing.transactional import TXN_PRODUCERS, TransactionalStrategy
from tracker import KAFKA_INTERNAL_TOPICS

DEFAULT_PRODUCER = {
    "linger.ms": 2,
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 1_000_000,
    "queue.buffering.max.kbytes": 1_048_576,
    "compression.type": "lz4",
    "log_level": 4,
}
# Reconnection after a broker restart: librdkafka's default back-off grows to 10 s between attempts,
# so a producer could sit idle for seconds after the broker answers again. 1 s bounds that wait at
# the cost of at most one connection attempt a second per broker while it is gone. NELI's clients
# use the same bound (harvester.election.neli).
RECONNECT = {"reconnect.backoff.ms": 50, "reconnect.backoff.max.ms": 1000}
DEFAULT_PRODUCER.update(RECONNECT)


# Transactional publishing (defaults the kafka.client / kafka.producer settings may override): a
# transaction's records wait for its commit anyway, so lingering only lengthens every transaction
# (and the next rows wait for it); and a transaction's requests are small and back to back, which
# Nagle's algorithm delays. Fenced p99 at 2,000 rec/s here: 25-27 ms -> 20-21 ms.
TXN_PRODUCER = {"linger.ms": 0, "socket.nagle.disable": True}


def producer_config(
    bootstrap: str, client: dict, producer: dict, transactional_id: str = "", silent_wait_ms: int | None = None
) -> dict:
    """The data producer's settings: ours, then the configured ones, then what the reaper needs.
    With a transactional id, TXN_PRODUCER's defaults apply and the id is set. `silent_wait_ms`: how
    long a request or a connection waits on a broker that does not answer (librdkafka's defaults,
    30-60 s, keep a partition whose leader went silent unpublished that long after Kafka moved it;
    harvester.election.timeouts derives the election's)."""
    txn = TXN_PRODUCER if transactional_id else {}
    waits = {} if silent_wait_ms is None else silent_broker_defaults(silent_wait_ms, producer=True)
    conf = {"bootstrap.servers": bootstrap, **DEFAULT_PRODUCER, **waits, **txn, **client, **producer}
    for key, value in REQUIRED_PRODUCER.items():
        if key in conf and str(conf[key]).lower() != str(value).lower():
            raise ValueError(
                f"kafka producer setting {key}={conf[key]!r} is not allowed: reaper needs {value!r} "
                "to keep per-key order across failures"
            )
    conf.update(REQUIRED_PRODUCER)
    if transactional_id:
        conf["transactional.id"] = transactional_id
    return conf


class LifecycleError(RuntimeError):
    """start() on a component already started, or on one already stopped."""


class Lifecycle:
    """new -> started -> stopped, each step once (thread-safe)."""

    def __init__(self, what: str) -> None:
        self._what, self._state, self._lock = what, "new", threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._state != "new":
                raise LifecycleError(f"{self._what} cannot be started: it is {self._state}")
            self._state = "started"

    def stop(self) -> bool:
        """True the first time (there is something to stop), False afterwards."""
        with self._lock:
            first = self._state == "started"
            self._state = "stopped"
            return first


class Publisher:
    def __init__(
        self,
        conf: dict,
        store: StoreLike,
        metrics: MetricsLike,
        *,
        purge_batch: int = 5000,
        purge_workers: int = 2,
        providers: Providers = DEFAULT,
        on_failure: Callable[[str], None] = lambda why: None,
        reserved_topics: frozenset[str] = frozenset(),
    ) -> None:
        self._life = Lifecycle("publisher")
        self.transactional = "transactional.id" in conf
        self.settler = DeliverySettler(
            store,
            metrics,
            batch=purge_batch,
            workers=purge_workers,
            on_failure=on_failure,
            on_fatal=self._fatal,
            limits=TopicLimits(conf),
        )
        self.slot = ProducerSlot(
            conf,
            providers.producer,
            on_fatal=on_failure,
            after_poll=self.settler.wake_if_pending,
            on_retire=self._on_retire,
            producers=TXN_PRODUCERS if self.transactional else 1,
        )
        self.strategy: PlainStrategy | TransactionalStrategy
        self._plain: PlainStrategy
        if self.transactional:
            self.strategy = TransactionalStrategy(self.slot, self.settler, store, metrics, on_failure)
            self._plain = self.strategy.plain
        else:
            self.strategy = self._plain = PlainStrategy(self.slot, self.settler, store)
        # rows naming them are quarantined
        self._plain.missing.reserve(
            {**dict.fromkeys(KAFKA_INTERNAL_TOPICS, INTERNAL), **dict.fromkeys(reserved_topics, RESERVED)}
        )

    def _fatal(self) -> None:
        self.slot.broken = True

    def _on_retire(self) -> None:
        self.strategy.on_retire()

    def start(self) -> Publisher:
        self._life.start()
        self.settler.start()
        self.slot.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Drop whatever is still queued, serve the last reports, stop the threads."""
        if self._life.stop():
            self.slot.close(timeout)
            self.settler.stop(timeout)

    # ------------------------------------------------------------------ what the harvester uses

    def produce_rows(
        self,
        rows: list[tuple],
        leader_id: uuid.UUID,
        still_valid: Valid,
        valid_until: Deadline,
    ) -> int:
        """`rows` as OutboxStore.mark returns them, each ending with its message id."""
        return self.strategy.produce_rows(rows, leader_id, still_valid, valid_until)

    def prepare(self, still_valid: Valid, valid_until: Deadline) -> None:
        """Between batches, from the producing thread: get ready to publish (fenced mode: fence the
        previous leader now rather than when the first rows come)."""
        if isinstance(self.strategy, TransactionalStrategy):
            self.strategy.prepare(still_valid, valid_until)
        # rows held back for a topic that did not exist wait for no new rows to be checked again
        self._plain.recheck_missing(self.slot.current)

    def reserve(self, n: int) -> None:
        self.settler.reserve(n)

    def release(self, n: int) -> None:
        self.settler.release(n)

    def wait_below(self, limit: int, timeout: float) -> bool:
        return self.settler.wait_below(limit, timeout)

    def drain(self, timeout: float) -> bool:
        return self.settler.drain(timeout)

    def retire_producer(self, why: str, *, routine: bool = False) -> bool:
        return self.slot.retire(why, routine=routine)

    def replace_if_broken(self) -> bool:
        return self.slot.replace_if_broken()

    # ------------------------------------------------------------------ read-only views

    @property
    def producer(self):
        return self.slot.current

    @property
    def broken(self) -> bool:
        return self.slot.broken

    @property
    def in_flight(self) -> int:
        return self.settler.in_flight

    @property
    def progress(self) -> int:
        return self.settler.progress

    @property
    def delivered(self) -> int:
        return self.settler.delivered

    @property
    def purged_rows(self) -> int:
        return self.settler.purged_rows

    @property
    def dead_rows(self) -> int:
        return self.settler.dead_rows

    @property
    def produced(self) -> int:
        return self._plain.produced

    @property
    def queue_full_waits(self) -> int:
        return self._plain.queue_full_waits

    @property
    def queue_full_patience(self) -> float:
        return self._plain.queue_full_patience

    @queue_full_patience.setter
    def queue_full_patience(self, seconds: float) -> None:
        self._plain.queue_full_patience = seconds

    @property
    def retired(self) -> int:
        return self.slot.retired

    @property
    def txn_committed(self) -> int:
        return self.strategy.committed if isinstance(self.strategy, TransactionalStrategy) else 0

    @property
    def txn_aborted(self) -> int:
        return self.strategy.aborted if isinstance(self.strategy, TransactionalStrategy) else 0
