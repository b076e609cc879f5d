"""Prometheus collectors of the tracker and the acker (default registry; names fixed by the team brief).

Counted where the event happens in this process. No per-batch or per-record labels.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

acks_applied = Counter("reaper_acks_applied_total", "Item acks that cleared a pending bit")
acks_duplicate = Counter("reaper_acks_duplicate_total", "Item acks whose bit was already clear")
acks_dead_lettered = Counter("reaper_acks_dead_lettered_total", "Ack messages sent to the dead-letter topic")
ack_apply_duration = Histogram("reaper_ack_apply_duration_seconds", "Time to apply one set of folded ack masks")
acker_lag = Gauge("reaper_acker_lag_messages", "Ack-topic messages not yet consumed by this acker")
batches_completed = Counter("reaper_batches_completed_total", "Batches completed (closed with nothing pending)")
batches_expired = Counter("reaper_batches_expired_total", "Batches expired by the sweeper")
batches_opened = Counter("reaper_batches_opened_total", "Batches opened")
batches_closed = Counter("reaper_batches_closed_total", "Batches closed")
# issue 12: consumers' ack claims and the acker's bounded waits
settle_busy = Counter("reaper_settle_busy_total", "Batch settles skipped because another transaction held the batch row")
acker_deferred = Counter("reaper_acker_deferred_total",
                         "Acker applies that skipped batches locked by another transaction (retried later)")
acker_deferred_masks = Gauge("reaper_acker_deferred_masks", "Group masks the acker holds for locked batches")
