"""What the dashboard shows: its rows and panels, as data (deploy/grafana/dashboard.py lays them
out as Grafana JSON).

Every metric name comes from the sidecar's collectors (harvester.metrics.names), so the panels
query exactly what a reaper with that `metrics.prefix` exports; tests/test_prometheus_live.py
queries every expression against a real Prometheus scraping a running reaper. `$job` selects the
deployment, `$__rate_interval` is Grafana's rate window.
"""

from __future__ import annotations

from types import SimpleNamespace

from harvester.metrics import names

J = '{job=~"$job"}'
R = "[$__rate_interval]"


def rate(metric: str) -> str:
    return f"sum(rate({metric}{J}{R}))"


def quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{J}{R})))"


def rows(prefix: str) -> list:
    """(row title, [(panel title, kind, unit, width, [(expr, legend)], description)]) for `prefix`."""
    m = SimpleNamespace(**names(prefix))
    return [
        (
            "Overview",
            [
                (
                    "Leaders",
                    "stat",
                    "none",
                    3,
                    [(f"sum({m.leader}{J})", "leaders")],
                    "Harvest units led (by instances not fenced). The unit count is healthy (1 with one outbox and one "
                    "lane); 0 means nothing publishes.",
                ),
                (
                    "Instances",
                    "stat",
                    "none",
                    3,
                    [(f"count({m.build_info}{J})", "instances")],
                    "Reaper instances being scraped.",
                ),
                (
                    "Published / s",
                    "stat",
                    "ops",
                    3,
                    [(rate(m.published), "published/s")],
                    "Outbox rows published to Kafka per second, all instances.",
                ),
                (
                    "Backlog rows",
                    "stat",
                    "short",
                    3,
                    [(f"max({m.backlog_rows}{J})", "rows")],
                    "Rows in the outbox table (committed, not yet purged).",
                ),
                (
                    "Oldest unpublished row",
                    "stat",
                    "s",
                    4,
                    [(f"max({m.oldest_age}{J})", "age")],
                    "Age of the oldest row still in the outbox: the delay consumers see.",
                ),
                (
                    "Items pending",
                    "stat",
                    "short",
                    4,
                    [(f"max({m.items_pending}{J})", "pending")],
                    "Items of open and closed batches not yet acknowledged.",
                ),
                (
                    "Version",
                    "stat",
                    "none",
                    4,
                    [(f"count by (version) ({m.build_info}{J})", "{{version}}")],
                    f"Instances per reaper version ({m.build_info}).",
                ),
            ],
        ),
        (
            "Throughput",
            [
                (
                    "Records per second",
                    "timeseries",
                    "ops",
                    12,
                    [
                        (rate(m.marked), "marked"),
                        (rate(m.published), "published"),
                        (rate(m.purged), "purged"),
                    ],
                    "Marked by the leader, published (delivery report received) and purged (deleted from the outbox).",
                ),
                (
                    "Records in flight",
                    "timeseries",
                    "short",
                    12,
                    [(f"sum by (instance) ({m.in_flight}{J})", "{{instance}}")],
                    "Produced and awaiting a delivery report; bounded by harvester.max_in_flight.",
                ),
                (
                    "Produce latency (enqueue to delivery report)",
                    "timeseries",
                    "s",
                    12,
                    [
                        (quantile(0.5, m.produce_duration), "p50"),
                        (quantile(0.99, m.produce_duration), "p99"),
                    ],
                    "From handing the record to the producer to its delivery report.",
                ),
                (
                    "Mark and purge statements, transaction commits",
                    "timeseries",
                    "s",
                    12,
                    [
                        (quantile(0.99, m.mark_duration), "mark p99"),
                        (quantile(0.99, m.purge_duration), "purge p99"),
                        (quantile(0.99, m.txn_duration), "commit p99"),
                    ],
                    "Duration of the mark query, of one batched purge statement and (harvester.transactional_id) "
                    "of one Kafka transaction commit.",
                ),
            ],
        ),
        (
            "Backlog",
            [
                (
                    "Outbox backlog rows",
                    "timeseries",
                    "short",
                    12,
                    [(f"max({m.backlog_rows}{J})", "rows")],
                    "Rows waiting in the outbox table. Growth with steady publishing means producers outpace the harvester.",
                ),
                (
                    "Age of the oldest unpublished row",
                    "timeseries",
                    "s",
                    12,
                    [(f"max({m.oldest_age}{J})", "oldest")],
                    "Alerts: ReaperOutboxBacklogOld (> 5 min), ReaperOutboxBacklogVeryOld (> 30 min).",
                ),
            ],
        ),
        (
            "Leadership",
            [
                (
                    "Leader by instance",
                    "timeseries",
                    "none",
                    12,
                    [(f"max by (instance) ({m.leader}{J})", "{{instance}}")],
                    "1 while an instance leads and is not fenced. A handover shows as one line dropping and another rising.",
                ),
                (
                    "Leadership changes",
                    "timeseries",
                    "short",
                    12,
                    [
                        (f"sum(increase({m.acquisitions}{J}{R}))", "acquisitions"),
                        (f"sum(increase({m.fences}{J}{R}))", "fences"),
                        (f"sum(increase({m.revocations}{J}{R}))", "revocations"),
                        (f"sum(increase({m.step_downs}{J}{R}))", "step-downs"),
                    ],
                    "Acquired leadership; fenced itself after missing heartbeats; lost a unit's leader-topic partition in a rebalance; "
                    "stepped down (left the leader group) while its database went unanswered.",
                ),
            ],
        ),
        (
            "Harvest units",
            [
                (
                    "Leader of each unit",
                    "timeseries",
                    "none",
                    8,
                    [(f"max by (unit, instance) ({m.unit_leader}{J})", "{{unit}} @ {{instance}}")],
                    "1 while the instance leads the unit (an outbox, or a lane of one) and is not fenced. Units spread "
                    "over the instances; alerts: ReaperUnitNoLeader, ReaperSeveralLeaders.",
                ),
                (
                    "Marked and published per unit",
                    "timeseries",
                    "ops",
                    8,
                    [
                        (f"sum by (unit) (rate({m.unit_marked}{J}{R}))", "{{unit}} marked"),
                        (f"sum by (unit) (rate({m.unit_published}{J}{R}))", "{{unit}} published"),
                    ],
                    "Rows marked and records acknowledged by Kafka per second, by unit. A unit at 0 while its backlog "
                    "grows is stalled.",
                ),
                (
                    "In flight and remarks per unit",
                    "timeseries",
                    "short",
                    8,
                    [
                        (f"sum by (unit) ({m.unit_in_flight}{J})", "{{unit}} in flight"),
                        (f"sum by (unit) (increase({m.unit_force_remarks}{J}{R}))", "{{unit}} remarks"),
                    ],
                    "Records produced and not yet settled, and forced remarks, by unit.",
                ),
            ],
        ),
        (
            "Failures",
            [
                (
                    "Resets, produce errors, force remarks, quarantined rows",
                    "timeseries",
                    "ops",
                    12,
                    [
                        (rate(m.reset), "reset"),
                        (rate(m.produce_errors), "produce errors"),
                        (rate(m.force_remarks), "force remarks"),
                        (rate(m.dead), "quarantined (outbox_dead)"),
                        (rate(m.txn_aborted), "transactions aborted"),
                        (rate(m.marks_refused), "marks refused after the lease"),
                        (
                            rate(m.claim_refusals),
                            "marks held back: table held by another configuration",
                        ),
                    ],
                    "A failed delivery resets its row and forces a re-mark from the head of the outbox. A row Kafka "
                    "can never accept (too large, no such partition, invalid topic name) is moved to outbox_dead. "
                    "With harvester.transactional_id, a failed record aborts its batch's transaction. A mark that "
                    "reaches or finishes in the database after the lease ended is refused (nothing marked). Marks "
                    "held back: another configuration (leader group/topic, outbox name, lanes) holds the table.",
                ),
                (
                    "Dead-lettered acks",
                    "timeseries",
                    "ops",
                    12,
                    [(rate(m.acks_dead_lettered), "dead-lettered")],
                    "Acks the tracker rejected (unknown batch or group, bad index, malformed id, expired batch).",
                ),
                (
                    "Acks waiting on busy batches",
                    "timeseries",
                    "short",
                    12,
                    [
                        (rate(m.acker_deferred), "acker applies deferred"),
                        (f"max({m.acker_deferred_masks}{J})", "masks held by the acker"),
                        (rate(m.settle_busy), "settles skipped: batch busy"),
                    ],
                    "The acker skips (SKIP LOCKED) batches another transaction holds and retries them; the settler "
                    "skips busy batches until its next pass. Steady non-zero values mean a long transaction sits on a batch.",
                ),
                (
                    "Seconds since the settler's and the sweeper's last pass",
                    "timeseries",
                    "s",
                    12,
                    [
                        (f"time() - max({m.settler_last_run}{J} > 0)", "settler"),
                        (f"time() - max({m.sweeper_last_run}{J} > 0)", "sweeper"),
                    ],
                    "The newest pass of any reaper. The settler passes every settler.interval, the sweeper every "
                    "sweeper.interval: a line far above its interval means that loop is stuck or failing (its logs say why).",
                ),
                (
                    "Dead rows and requeues",
                    "timeseries",
                    "short",
                    12,
                    [
                        (f"max({m.dead_rows}{J})", "in outbox_dead"),
                        (f"max(delta({m.requeued_rows}{J}{R}))", "requeued"),
                    ],
                    "Rows waiting in outbox_dead (`reaper dead list`), and rows `reaper dead requeue` moved back into "
                    "the outbox. Alert: ReaperDeadRowsWaiting (any for an hour).",
                ),
                (
                    "Expired batches",
                    "timeseries",
                    "short",
                    12,
                    [
                        (f"sum(increase({m.batches_expired}{J}{R}))", "expired by sweepers"),
                        (f'max({m.batches}{{job=~"$job", state="expired"}})', "expired, kept until retention"),
                    ],
                    "Batches that will never complete: idle past sweeper.idle_expiry, or `reaper batch expire`. Each "
                    "sent one expiry event. Alert: ReaperBatchesExpired.",
                ),
            ],
        ),
        (
            "Acks",
            [
                (
                    "Acks per second",
                    "timeseries",
                    "ops",
                    8,
                    [
                        (rate(m.acks_applied), "applied"),
                        (rate(m.acks_duplicate), "duplicate"),
                        (rate(m.acker_failures_applied), "failures applied"),
                    ],
                    "Bits cleared by the acker, acks for bits already clear (redeliveries, retries), and "
                    "failures from the ack topic that finished a pending item.",
                ),
                (
                    "Ack apply duration",
                    "timeseries",
                    "s",
                    8,
                    [
                        (quantile(0.5, m.ack_apply_duration), "p50"),
                        (quantile(0.99, m.ack_apply_duration), "p99"),
                    ],
                    "Applying one polled chunk of acks as per-group masks.",
                ),
                (
                    "Acker lag",
                    "timeseries",
                    "short",
                    8,
                    [(f"sum by (instance) ({m.acker_lag}{J})", "{{instance}}")],
                    "Ack messages not yet consumed, per instance (its assigned partitions).",
                ),
            ],
        ),
        (
            "Batches",
            [
                (
                    "Batches by state",
                    "timeseries",
                    "short",
                    8,
                    [(f"max by (state) ({m.batches}{J})", "{{state}}")],
                    "Rows of the batch table per state (open, closed, complete, expired).",
                ),
                (
                    "Items pending",
                    "timeseries",
                    "short",
                    8,
                    [(f"max({m.items_pending}{J})", "pending")],
                    "Items not yet acknowledged across open and closed batches.",
                ),
                (
                    "Batch lifecycle",
                    "timeseries",
                    "short",
                    8,
                    [
                        (f"sum(increase({m.batches_opened}{J}{R}))", "opened"),
                        (f"sum(increase({m.batches_closed}{J}{R}))", "closed"),
                        (f"sum(increase({m.batches_completed}{J}{R}))", "completed"),
                        (f"sum(increase({m.batches_expired}{J}{R}))", "expired"),
                    ],
                    "Counted in the process where each happened: opened/closed in applications that serve "
                    "metrics, completed by the acker (or an app's tracker.ack), expired by the sweeper.",
                ),
            ],
        ),
        (
            "Inbox",
            [
                (
                    "Inbox messages / s",
                    "timeseries",
                    "ops",
                    8,
                    [
                        (f"sum by (consumer) (rate({m.inbox_processed}{J}{R}))", "processed {{consumer}}"),
                        (f"sum by (consumer) (rate({m.inbox_deduplicated}{J}{R}))", "duplicates {{consumer}}"),
                    ],
                    "Messages consumers recorded in their inbox the first time (the effect ran) and duplicates "
                    "(skipped), counted in the consuming processes that serve metrics.",
                ),
                (
                    "Inbox size",
                    "timeseries",
                    "bytes",
                    8,
                    [(f"max({m.inbox_bytes}{J})", "bytes"), (f"max({m.inbox_ids}{J})", "ids (estimate)")],
                    "Partitions of the inbox with their indexes, and the ids they keep (table statistics).",
                ),
                (
                    "Inbox retention",
                    "timeseries",
                    "s",
                    8,
                    [
                        (f"max({m.inbox_oldest_age}{J})", "oldest partition holding ids"),
                        (f"sum(increase({m.inbox_partitions_dropped}{J}{R}))", "partitions dropped"),
                        (f"sum(increase({m.inbox_maintenance_failures}{J}{R}))", "failed runs"),
                    ],
                    "Age of the oldest inbox partition holding ids (about inbox.retention + inbox.bucket when "
                    "the maintenance keeps up), partitions dropped and failed maintenance runs.",
                ),
            ],
        ),
    ]
