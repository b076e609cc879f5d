"""Prometheus collectors of the tracker and the acker.

The tracker calls' collectors (`TrackerMetrics`) are made once per registry and labelled by schema,
so two `Tracker`s in one process count apart. They count when a call returns: a call made in the
caller's transaction is counted even if the caller later rolls back (psycopg has no commit hook),
and the help texts say so. The acker's own collectors below count its own committed transactions.
No per-batch or per-record labels.
"""

from __future__ import annotations

import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_CALLER = " (counted when the call returns; the caller's transaction may still roll back)"


class TrackerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["schema"]
        self.acks_applied = Counter(
            "reaper_acks_applied_total", "Item acks that cleared a pending bit" + _CALLER, labels, registry=registry
        )
        self.acks_duplicate = Counter(
            "reaper_acks_duplicate_total", "Item acks whose bit was already clear" + _CALLER, labels, registry=registry
        )
        self.ack_apply_duration = Histogram(
            "reaper_ack_apply_duration_seconds", "Time to apply one set of folded ack masks", labels, registry=registry
        )
        self.batches_completed = Counter(
            "reaper_batches_completed_total",
            "Batches completed (closed with nothing pending)" + _CALLER,
            labels,
            registry=registry,
        )
        self.batches_opened = Counter(
            "reaper_batches_opened_total", "Batches opened" + _CALLER, labels, registry=registry
        )
        self.batches_closed = Counter(
            "reaper_batches_closed_total", "Batches closed" + _CALLER, labels, registry=registry
        )


_made: weakref.WeakKeyDictionary[CollectorRegistry, TrackerMetrics] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def for_registry(registry: CollectorRegistry) -> TrackerMetrics:
    """The tracker collectors of `registry`, registered on first use."""
    with _lock:
        got = _made.get(registry)
        if got is None:
            got = _made[registry] = TrackerMetrics(registry)
        return got


# The acker's and sweeper's collectors (default registry).
acks_dead_lettered = Counter("reaper_acks_dead_lettered_total", "Ack messages sent to the dead-letter topic")
acker_lag = Gauge("reaper_acker_lag_messages", "Ack-topic messages not yet consumed by this acker")
batches_expired = Counter("reaper_batches_expired_total", "Batches expired by the sweeper")

# issue 12: the acker's bounded waits and the settler (default registry)
acker_deferred = Counter(
    "reaper_acker_deferred_total", "Acker applies that skipped batches locked by another transaction (retried later)"
)
acker_deferred_masks = Gauge("reaper_acker_deferred_masks", "Group masks the acker holds for locked batches")
settle_busy = Counter(
    "reaper_settle_busy_total", "Batch settles skipped because another transaction held the batch row (tried again)"
)

__all__ = [
    "TrackerMetrics",
    "for_registry",
    "REGISTRY",
    "acks_dead_lettered",
    "acker_lag",
    "batches_expired",
    "acker_deferred",
    "acker_deferred_masks",
    "settle_busy",
]
