"""Prometheus collectors of the tracker's calls.

`TrackerMetrics` is made once per registry and prefix, and labelled by schema, so two `Tracker`s
in one process count apart. The names are `<prefix>_acks_applied_total` and so on; the prefix is
`reaper` unless the `Tracker` (or `settle`) is given another one. They count when a call returns:
a call made in the caller's transaction is counted even if the caller later rolls back (psycopg
has no commit hook), and the help texts say so. No per-batch or per-record labels.

The reaper's own loops (acker, claim settler, sweeper) count in the sidecar's collectors
(harvester.metrics), under its configured prefix.
"""

from __future__ import annotations

import re
import threading
import weakref

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from tracker.errors import InvalidArgument, InvalidValue

DEFAULT_PREFIX = "reaper"
_CALLER = " (counted when the call returns; the caller's transaction may still roll back)"


def check_prefix(prefix: object, name: str = "metrics_prefix") -> str:
    """`prefix` if it can start a Prometheus metric name; else InvalidArgument (not a str) or
    InvalidValue naming it as written."""
    if not isinstance(prefix, str):
        raise InvalidArgument(name, prefix, "a str")
    if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", prefix):
        raise InvalidValue(name, prefix, "is not a metric name prefix (letters, digits, _; not starting with a digit)")
    return prefix


class TrackerMetrics:
    def __init__(self, registry: CollectorRegistry | None, prefix: str = DEFAULT_PREFIX) -> None:
        p = check_prefix(prefix)
        labels = ["schema"]

        def calls(name: str, doc: str) -> Counter:
            """`<prefix>_<name>_total`: what the tracker's calls did, by schema, counted when they return."""
            return Counter(f"{p}_{name}_total", doc + _CALLER, labels, registry=registry)

        self.acks_applied = calls("acks_applied", "Item acks that cleared a pending bit")
        self.acks_duplicate = calls("acks_duplicate", "Item acks whose bit was already clear")
        self.ack_apply_duration = Histogram(
            f"{p}_ack_apply_duration_seconds", "Time to apply one set of folded ack masks", labels, registry=registry
        )
        self.batches_completed = calls(
            "batches_completed", "Batches completed (closed with nothing pending, or finished by a failure threshold)"
        )
        self.batches_opened = calls("batches_opened", "Batches opened")
        self.batches_expired = calls("batches_expired", "Batches expired (by a sweep or an operator's expire_batch)")
        self.batches_closed = calls("batches_closed", "Batches closed")
        # The inbox (tracker.inbox), by schema and consumer: consumers are named in configuration,
        # a handful per schema.
        inbox = ["schema", "consumer"]
        self.inbox_processed = Counter(
            f"{p}_inbox_processed_total",
            "Messages an inbox recorded the first time (their effect ran)" + _CALLER,
            inbox,
            registry=registry,
        )
        self.inbox_deduplicated = Counter(
            f"{p}_inbox_deduplicated_total",
            "Messages an inbox had recorded already (a duplicate: their effect did not run)" + _CALLER,
            inbox,
            registry=registry,
        )


_made: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, TrackerMetrics]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def for_registry(registry: CollectorRegistry, prefix: str = DEFAULT_PREFIX) -> TrackerMetrics:
    """The tracker collectors of `registry` with names starting `<prefix>_`, registered on first use."""
    check_prefix(prefix)
    with _lock:
        by_prefix = _made.setdefault(registry, {})
        got = by_prefix.get(prefix)
        if got is None:
            got = by_prefix[prefix] = TrackerMetrics(registry, prefix)
        return got


__all__ = ["DEFAULT_PREFIX", "REGISTRY", "TrackerMetrics", "check_prefix", "for_registry"]
