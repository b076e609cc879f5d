"""Prometheus collectors of the reaper sidecar (served by harvester.health_server).

Every name the sidecar exports starts with `metrics.prefix` (default "reaper"): the harvester's,
the acker's, the claim settler's and the sweeper's collectors below, and the tracker calls'
collectors (tracker.metrics) its Tracker registers under the same prefix. The names after the
prefix are part of the product's interface (the documentation's metrics page); the alert rules and the
Grafana dashboard in deploy/ are generated from them (`names`). Collectors live in the default
registry, created once per process and prefix. No per-record or per-batch labels.
"""

from __future__ import annotations

import threading
from typing import Protocol

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.metrics import MetricWrapperBase

from tracker.metrics import DEFAULT_PREFIX, TrackerMetrics, check_prefix

_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_lock = threading.Lock()
_instances: dict[str, HarvesterMetrics] = {}


class HarvesterMetrics:
    def __init__(self, prefix: str = DEFAULT_PREFIX, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.prefix = p = check_prefix(prefix, "metrics.prefix")
        r = registry
        self.build_info = Gauge(f"{p}_build_info", "Build of the running reaper (value 1)", ["version"], registry=r)
        self.leader = Gauge(
            f"{p}_leader", "Harvest units this instance leads and is not fenced for (1 with one unit)", registry=r
        )
        self.acquisitions = Counter(
            f"{p}_leader_acquisitions_total",
            "Leadership acquisitions (a harvest unit's leader-topic partition assigned, or a fence ended)",
            registry=r,
        )
        self.fences = Counter(
            f"{p}_leader_fences_total", "Times the leader fenced itself (no heartbeat in time)", registry=r
        )
        self.revocations = Counter(
            f"{p}_leader_revocations_total",
            "Times a harvest unit's leader-topic partition was revoked or lost",
            registry=r,
        )
        self.step_downs = Counter(
            f"{p}_leader_step_downs_total",
            "Times this instance fenced and left the leader group because its database work went unanswered "
            "for harvester.step_down_after",
            registry=r,
        )
        self.marked = Counter(f"{p}_records_marked_total", "Outbox rows marked for publication", registry=r)
        self.published = Counter(f"{p}_records_published_total", "Records acknowledged by Kafka", registry=r)
        self.purged = Counter(f"{p}_records_purged_total", "Outbox rows deleted after acknowledgement", registry=r)
        self.reset = Counter(f"{p}_records_reset_total", "Outbox rows unmarked after a failed publication", registry=r)
        self.dead = Counter(
            f"{p}_records_dead_total",
            "Outbox rows Kafka will never accept, moved to the dead table (outbox_dead)",
            registry=r,
        )
        self.produce_errors = Counter(
            f"{p}_produce_errors_total",
            "Failed produce calls and delivery reports, retried (rows Kafka can never accept count in records_dead_total)",
            registry=r,
        )
        self.force_remarks = Counter(
            f"{p}_force_remarks_total", "Times queued work was dropped and marking restarted from the head", registry=r
        )
        self.marks_refused = Counter(
            f"{p}_marks_refused_total",
            "Marks the database refused because they reached or finished there after the lease ended "
            "(nothing marked; rising while leading: check the clocks)",
            registry=r,
        )
        self.claim_refusals = Counter(
            f"{p}_outbox_claim_refusals_total",
            "Marks not made because this configuration could not hold the outbox table (harvester.publishing.ownership): "
            "another configuration (Kafka cluster, leader group/topic, outbox, lanes) holds it, or "
            "harvest_claim is missing or not permitted",
            registry=r,
        )
        self.mark_duration = Histogram(
            f"{p}_mark_duration_seconds", "Mark query duration", buckets=_DURATION_BUCKETS, registry=r
        )
        self.purge_duration = Histogram(
            f"{p}_purge_duration_seconds", "Batched purge statement duration", buckets=_DURATION_BUCKETS, registry=r
        )
        self.produce_duration = Histogram(
            f"{p}_produce_duration_seconds",
            "Enqueue to delivery report, sampled about once per 64 records delivered",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.txn_duration = Histogram(
            f"{p}_transaction_commit_duration_seconds",
            "commit_transaction duration (harvester.transactional_id set)",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.txn_aborted = Counter(
            f"{p}_transactions_aborted_total",
            "Kafka transactions aborted, their rows left for a remark (harvester.transactional_id set)",
            registry=r,
        )
        self.in_flight = Gauge(f"{p}_records_in_flight", "Records produced and not yet settled", registry=r)
        self.backlog_rows = Gauge(
            f"{p}_outbox_backlog_rows",
            "Rows in the outboxes, summed (each exact up to 100,000, above that the id span max(id) - min(id) + 1)",
            registry=r,
        )
        self.oldest_age = Gauge(f"{p}_outbox_oldest_age_seconds", "Age of the oldest row in any outbox", registry=r)
        self.batches = Gauge(
            f"{p}_batches",
            "Batches by state (complete and expired: exact up to 100,000 of them, above that Postgres's statistics)",
            ["state"],
            registry=r,
        )
        self.dead_rows = Gauge(
            f"{p}_outbox_dead_rows",
            "Rows in the outboxes' dead tables, summed (quarantined, not yet requeued; each counted up to 100,001)",
            registry=r,
        )
        self.requeued_rows = Gauge(
            f"{p}_outbox_requeued_rows",
            "Rows `reaper dead requeue` moved back into the outbox, all time (read from admin_log)",
            registry=r,
        )
        self.items_pending = Gauge(
            f"{p}_items_pending", "Items not yet acknowledged in open and closed batches", registry=r
        )
        # Per harvest unit (see the running and scaling how-to): one series per unit this instance has run.
        u = ["unit"]
        self.unit_leader = Gauge(
            f"{p}_unit_leader", "1 while this instance leads the unit and is not fenced", u, registry=r
        )
        self.unit_marked = Counter(f"{p}_unit_records_marked_total", "Outbox rows marked, by unit", u, registry=r)
        self.unit_published = Counter(
            f"{p}_unit_records_published_total", "Records acknowledged by Kafka, by unit", u, registry=r
        )
        self.unit_force_remarks = Counter(f"{p}_unit_force_remarks_total", "Forced remarks, by unit", u, registry=r)
        self.unit_in_flight = Gauge(
            f"{p}_unit_records_in_flight", "Records produced and not yet settled, by unit", u, registry=r
        )
        # The acker (harvester.services.acker), one per schema with an ack topic, each counting under
        # its schema; the acks it applies count in the tracker's collectors.
        a = ["schema"]
        self.acks_dead_lettered = Counter(
            f"{p}_acks_dead_lettered_total",
            "Dead letters the acker sent: one per ack entry it could not apply, or one per ack message set aside whole",
            a,
            registry=r,
        )
        self.acker_lag = Gauge(
            f"{p}_acker_lag_messages", "Ack-topic messages not yet consumed by this acker", a, registry=r
        )
        self.acker_deferred = Counter(
            f"{p}_acker_deferred_total",
            "Acker applies that skipped batches locked by another transaction (retried later)",
            a,
            registry=r,
        )
        self.acker_deferred_masks = Gauge(
            f"{p}_acker_deferred_masks", "Group masks the acker holds for locked batches", a, registry=r
        )
        # Its failures: the tracker's acks_applied counts acks only, so failures count here.
        self.acker_failures_applied = Counter(
            f"{p}_acker_failures_applied_total",
            "Item failures from the ack topic that finished a pending item",
            a,
            registry=r,
        )
        # The inbox (tracker.inbox) of the schema, read by the inbox maintenance (harvester.services.inbox).
        self.inbox_bytes = Gauge(f"{p}_inbox_bytes", "Size of the inbox's partitions with their indexes", registry=r)
        self.inbox_ids = Gauge(
            f"{p}_inbox_ids", "Message ids kept in the inbox (from the table statistics: an estimate)", registry=r
        )
        self.inbox_oldest_age = Gauge(
            f"{p}_inbox_oldest_age_seconds",
            "Age of the start of the oldest inbox partition holding ids (the oldest id kept is at most this old)",
            registry=r,
        )
        self.inbox_partitions_dropped = Counter(
            f"{p}_inbox_partitions_dropped_total", "Expired inbox partitions dropped whole", registry=r
        )
        self.inbox_maintenance_failures = Counter(
            f"{p}_inbox_maintenance_failures_total",
            "Inbox maintenance runs that failed (retried next interval)",
            registry=r,
        )
        # The claim settler (harvester.services.claim_settler); the sweeper's expiries count in the tracker's collectors.
        self.settle_busy = Counter(
            f"{p}_settle_busy_total",
            "Batch settles skipped because another transaction held the batch row (tried again)",
            registry=r,
        )
        # When each loop last finished a pass (the console's overview shows them; 0: never yet).
        self.settler_last_run = Gauge(
            f"{p}_settler_last_run_timestamp_seconds", "Unix time the settler last finished a pass", registry=r
        )
        self.sweeper_last_run = Gauge(
            f"{p}_sweeper_last_run_timestamp_seconds", "Unix time the sweeper last finished a sweep", registry=r
        )


class _Both:
    """A counter (or histogram) observed in the instance's total and in the unit's series."""

    def __init__(self, total, unit) -> None:
        self._total, self._unit = total, unit

    def inc(self, n: float = 1) -> None:
        self._total.inc(n)
        self._unit.inc(n)


class _SummedGauge:
    """A gauge set per unit whose instance-wide series is the sum over the units."""

    def __init__(self, total: Gauge, unit, key: str, shares: dict, lock: threading.Lock) -> None:
        self._total, self._unit, self._key, self._shares, self._lock = total, unit, key, shares, lock

    def set(self, value: float) -> None:
        self._unit.set(value)
        with self._lock:
            self._shares[self._key] = value
            self._total.set(sum(self._shares.values()))


class _Inc(Protocol):
    def inc(self, amount: float = ..., /) -> None: ...


class _Set(Protocol):
    def set(self, value: float, /) -> None: ...


class MetricsLike(Protocol):
    """What a harvest unit's parts update: a HarvesterMetrics, or a UnitMetrics (per-unit series)."""

    acquisitions: Counter
    fences: Counter
    revocations: Counter
    produce_errors: Counter
    dead: Counter
    purged: Counter
    reset: Counter
    txn_aborted: Counter
    marks_refused: Counter
    claim_refusals: Counter
    mark_duration: Histogram
    produce_duration: Histogram
    purge_duration: Histogram
    txn_duration: Histogram

    @property
    def leader(self) -> _Set: ...
    @property
    def in_flight(self) -> _Set: ...
    @property
    def marked(self) -> _Inc: ...
    @property
    def published(self) -> _Inc: ...
    @property
    def force_remarks(self) -> _Inc: ...


class UnitMetrics:
    """The metrics one harvest unit updates: the instance's, plus its own `unit` series where
    HarvesterMetrics has one. Exposes the same attributes as HarvesterMetrics."""

    # Copied from the instance's HarvesterMetrics by __init__; declared for the type checker.
    acquisitions: Counter
    fences: Counter
    revocations: Counter
    produce_errors: Counter
    dead: Counter
    purged: Counter
    reset: Counter
    txn_aborted: Counter
    marks_refused: Counter
    claim_refusals: Counter
    mark_duration: Histogram
    produce_duration: Histogram
    purge_duration: Histogram
    txn_duration: Histogram

    _sums: dict[tuple[int, str], dict] = {}
    _sums_lock = threading.Lock()

    def __init__(self, base: HarvesterMetrics, unit: str) -> None:
        self.__dict__.update(base.__dict__)
        self.unit = unit
        with UnitMetrics._sums_lock:
            leaders = UnitMetrics._sums.setdefault((id(base), "leader"), {})
            in_flight = UnitMetrics._sums.setdefault((id(base), "in_flight"), {})
        self.leader = _SummedGauge(base.leader, base.unit_leader.labels(unit), unit, leaders, UnitMetrics._sums_lock)
        self.in_flight = _SummedGauge(
            base.in_flight, base.unit_in_flight.labels(unit), unit, in_flight, UnitMetrics._sums_lock
        )
        self.marked = _Both(base.marked, base.unit_marked.labels(unit))
        self.published = _Both(base.published, base.unit_published.labels(unit))
        self.force_remarks = _Both(base.force_remarks, base.unit_force_remarks.labels(unit))


def get(prefix: str = DEFAULT_PREFIX) -> HarvesterMetrics:
    """The sidecar's collectors with this prefix in the default registry, made on first use."""
    with _lock:
        if prefix not in _instances:
            _instances[prefix] = HarvesterMetrics(prefix)
        return _instances[prefix]


def exported_name(collector: MetricWrapperBase) -> str:
    """The name a collector's samples carry, as queries write it: counters with `_total`,
    histograms without their `_bucket`/`_sum`/`_count` suffixes."""
    family = next(iter(collector.describe()))
    return f"{family.name}_total" if family.type == "counter" else family.name


def names(prefix: str = DEFAULT_PREFIX) -> dict[str, str]:
    """Every metric `reaper run` exports with this prefix, by attribute name (HarvesterMetrics'
    and TrackerMetrics'), read from the collectors themselves (made on a throwaway registry)."""
    scratch = CollectorRegistry()
    found: dict[str, str] = {}
    for source in (HarvesterMetrics(prefix, scratch), TrackerMetrics(scratch, prefix)):
        for attr, value in vars(source).items():
            if isinstance(value, (Counter, Gauge, Histogram)):
                assert attr not in found, f"two collectors named {attr}"
                found[attr] = exported_name(value)
    return found


def histograms(prefix: str = DEFAULT_PREFIX) -> set[str]:
    """The names among `names(prefix)` that are histograms (queried as `<name>_bucket` and so on)."""
    scratch = CollectorRegistry()
    return {
        exported_name(v)
        for source in (HarvesterMetrics(prefix, scratch), TrackerMetrics(scratch, prefix))
        for v in vars(source).values()
        if isinstance(v, Histogram)
    }
