"""The interfaces the harvester reaches Kafka and the outbox through, and how to supply them.

Production passes nothing and gets confluent_kafka.Producer (for records and for leader
heartbeats) and harvester.publishing.outbox_sql.OutboxStore. Tests supply other providers
(tests/support/faults.py wraps them to inject failures or hold heartbeats back); no production
module imports them.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from confluent_kafka import Producer

from tracker import message_ids


class ProducerLike(Protocol):
    """What the harvester uses of confluent_kafka.Producer."""

    def produce(self, *args, **kwargs) -> None: ...
    def poll(self, timeout: float = ...) -> int: ...
    def flush(self, timeout: float = ...) -> int: ...
    def purge(self, in_queue: bool = ..., in_flight: bool = ..., blocking: bool = ...) -> None: ...
    def init_transactions(self, timeout: float = ...) -> None: ...
    def begin_transaction(self) -> None: ...
    def commit_transaction(self, timeout: float = ...) -> None: ...
    def abort_transaction(self, timeout: float = ...) -> None: ...
    def list_topics(self, topic: str | None = ..., timeout: float = ...) -> object: ...
    def __len__(self) -> int: ...


class StoreLike(Protocol):
    """What the harvester uses of harvester.publishing.outbox_sql.OutboxStore."""

    def namespace(self) -> message_ids.Namespace: ...
    def mark(
        self, leader_id: uuid.UUID, limit: int, *, until: datetime, ids: message_ids.Namespace | None = None
    ) -> list[tuple]: ...
    def database_now(self) -> datetime: ...
    def purge(self, leader_id: uuid.UUID, ids: Sequence[int]) -> int: ...
    def reset(self, leader_id: uuid.UUID, ids: Sequence[int]) -> int: ...
    def quarantine(self, leader_id: uuid.UUID, ids: Sequence[int], reason: str) -> int: ...
    def vacuum(self) -> bool: ...


ProducerFactory = Callable[[dict], ProducerLike]
StoreWrapper = Callable[[StoreLike], StoreLike]


def _same(store: StoreLike) -> StoreLike:
    return store


@dataclass(frozen=True)
class Providers:
    """How a harvester makes its producers and wraps its outbox store (defaults: the real ones)."""

    producer: ProducerFactory = field(default=Producer)
    store: StoreWrapper = field(default=_same)
    heartbeat_producer: ProducerFactory = field(default=Producer)  # the leader election's (harvester.election.neli)
    description: str | None = None  # logged at start when not the defaults


DEFAULT = Providers()
