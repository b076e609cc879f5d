"""One runbook per alert of deploy/prometheus/rules.py: what it means, what to check, what to do.

The operations page of the documentation is generated from these and from the rules themselves
(deploy/docs_reference.py); an alert without a runbook, or a runbook without an alert, fails it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runbook:
    means: str
    check: tuple[str, ...]
    act: tuple[str, ...]


RUNBOOKS: dict[str, Runbook] = {
    "ReaperNoLeader": Runbook(
        means="No instance of the deployment is publishing: outbox rows accumulate (nothing is lost, "
        "they wait). Applications keep working; consumers see nothing new.",
        check=(
            "`/readyz` of each instance: it says whether the instance reaches Postgres and Kafka.",
            "The instances' logs for `fencing`, `neli follower` (leadership lost) or `not marking` lines, and for connection errors.",
            "That every instance uses the same `harvester.leader_topic` and `harvester.leader_group` "
            "(an instance whose units disagree with the leader topic's partitions refuses to start, exit code 2).",
        ),
        act=(
            "Restore the connectivity the logs name (Kafka brokers, Postgres, credentials); leadership "
            "is taken within one group session after an instance is healthy.",
            "If no instance runs, start one: `reaper -c reaper.yaml run`.",
        ),
    ),
    "ReaperAbsent": Runbook(
        means="Prometheus scrapes no reaper at all: either none runs, or the metrics port is unreachable.",
        check=(
            "The orchestrator: are the reaper's pods or containers running, or crash-looping (exit codes "
            "are listed in the command-line reference)?",
            "Prometheus' target page: is the metrics port (`metrics.port`) scraped, and with which error?",
            "The logs for `waiting for the database and Kafka`: a starting reaper serves no metrics until "
            "they answer, and exits with code 3 after `database.startup_timeout` (60 s).",
        ),
        act=(
            "Start the reaper, or fix what its exit code and last log lines name (configuration, "
            "database unreachable, Kafka unreachable).",
            "Fix the scrape configuration or the network policy in front of the metrics port.",
        ),
    ),
    "ReaperSeveralLeaders": Runbook(
        means="Two instances claim the same harvest unit for minutes. The database claim keeps only one "
        "marking, but per-key order is at risk if claims are not enforced in this deployment.",
        check=(
            "`reaper outbox status`: each unit's leader in the leader group, and the leader ids of its rows in flight.",
            "`SELECT outbox, layout, holder, held_until FROM <schema>.harvest_claim`: the configuration and "
            "the reaper that hold each outbox table.",
            "That `harvester.heartbeat_timeout` is below the consumer group's session timeout on every instance.",
            "That every instance uses one leader topic and one leader group (a second deployment with "
            "another group harvesting the same table is refused with `not marking`).",
        ),
        act=(
            "Stop the instance whose configuration differs; the other keeps or takes the unit within "
            "`heartbeat_timeout` + 1 s.",
            "If the configuration is the same everywhere, restart the instance whose logs show no "
            "heartbeat: it fences itself and the unit has one leader again.",
        ),
    ),
    "ReaperUnitNoLeader": Runbook(
        means="One harvest unit (an outbox table, or one lane of it) has no leader: its rows are not "
        "published while other units are.",
        check=(
            "`reaper outbox status` for that unit: its leader and backlog.",
            "The logs, filtered by the unit's name, for fencing, revocations or a refused claim.",
        ),
        act=(
            "Fix what the unit's log lines name; a healthy instance takes the unit within one group session.",
            "A refused claim: follow ReaperOutboxClaimRefused.",
        ),
    ),
    "ReaperOutboxBacklogOld": Runbook(
        means="The oldest unpublished row has waited more than 5 minutes: publication is slower than "
        "the writes, or stopped for part of the rows.",
        check=(
            "Leadership (`reaper_leader`, `reaper_unit_leader`): is every unit led?",
            "`reaper_produce_errors_total` and `reaper_records_reset_total`: are deliveries failing?",
            "The backlog (`reaper_outbox_backlog_rows`) against the publish rate: is it growing?",
        ),
        act=(
            "If deliveries fail, follow ReaperProduceErrors.",
            "If the rate is too low for the load, add lanes (`harvester.lanes`) or split the outbox "
            "into units, and check the database's and brokers' load.",
        ),
    ),
    "ReaperOutboxBacklogVeryOld": Runbook(
        means="Rows have waited more than 30 minutes: consumers are far behind what applications "
        "committed. Nothing is lost, but the delay is now visible to users.",
        check=(
            "Everything ReaperOutboxBacklogOld lists.",
            "`reaper outbox status`: the oldest row's id and topic and whether it is marked (in flight); a row whose topic does not exist stops no other topic's rows (the log says `topic does not exist`, naming it), but its topic's rows stay, in order, until the topic is created.",
        ),
        act=(
            "Restore publication first (leadership, Kafka); rows are published in order once it resumes.",
            "A row Kafka refuses for good is moved to the dead table and stops holding the backlog; "
            "see ReaperRowsQuarantined.",
        ),
    ),
    "ReaperResetsHigh": Runbook(
        means="Records keep being unmarked after failed deliveries and retried: the same rows are "
        "produced again and again.",
        check=(
            "The leader's logs for the delivery error (topic missing, record too large, authorisation, "
            "broker unreachable).",
            "`reaper_produce_errors_total`, the `produce failed` log lines and the `force remark` lines whose `reason` is `delivery failed: ...` (each names its error), and the brokers' health.",
        ),
        act=(
            "Fix the cause the error names: create the topic, raise `message.max.bytes`, grant the "
            "reaper's principal Write on the topic.",
            "Records that can never be delivered are quarantined on their own; nothing else is needed for them.",
        ),
    ),
    "ReaperProduceErrors": Runbook(
        means="Delivery reports have failed for 10 minutes. Failed rows are reset and retried, so "
        "nothing is lost, but the backlog ages.",
        check=(
            "The leader's log lines for the error code, and the brokers' state.",
            "Kafka ACLs for the reaper's principal (Write and Describe on the topics, and on the "
            "transactional id when transactions are on).",
        ),
        act=("Fix the broker, ACL or topic problem the error names; publication resumes by itself.",),
    ),
    "ReaperOutboxClaimRefused": Runbook(
        means="An instance is kept from harvesting an outbox table because another configuration "
        "(another Kafka cluster, leader group, topic or lane count) holds it. Two such deployments "
        "would break per-key order, so the second is refused.",
        check=(
            'The log line "not marking": it names the other configuration and the reaper holding the table.',
            "Whether a migration to new settings (lanes, cluster) is half done.",
        ),
        act=(
            "Stop whichever deployment should not run; the other takes the table over within "
            "`heartbeat_timeout` + 2 s (the claim's 1 s margin, then its next try a second later).",
            "If `harvest_claim` is missing or not permitted, run `reaper migrate` (and grant the "
            "reaper's role), as the log line's statement shows.",
        ),
    ),
    "ReaperRowsQuarantined": Runbook(
        means="Kafka refused some outbox rows for good (too large, an invalid topic name, a partition the topic lacks); "
        "they were moved to the dead table so that the rest keeps flowing.",
        check=("`reaper dead list`: each row with Kafka's reason.",),
        act=(
            "Fix the producer of the rows or the topic's settings.",
            "Then `reaper dead requeue --reason <text>` (or `--id`, `--all`) moves them back to the "
            "outbox, each exactly once.",
        ),
    ),
    "ReaperAcksDeadLettered": Runbook(
        means="Consumers send acks or failures the tracker rejects: unknown batch or group, index out "
        "of range, malformed id, expired batch. They are written to the dead-letter topic, not applied.",
        check=(
            "The dead-letter topic: each message holds the entry as written and the reason.",
            "Where they come from: the `source-topic` header names the ack topic (so the schema), and a "
            "malformed entry's `source-partition` and `source-offset` headers locate the message it came in; "
            "the `schema` label of `reaper_acks_dead_lettered_total` names the acker.",
            "Acks sent to another schema's ack topic: each schema's batches are acked on its own topic "
            "(`acker.topic`, or the `ack_topic` of its `harvester.outboxes` entries), and an id read from "
            "another schema's topic is an unknown batch or group there.",
        ),
        act=(
            "Fix the consumer that builds ids (ids are `<batch>:<group>:<index>`, exactly as received).",
            "Acks for expired batches need nothing: the batch already ended with an expiry event.",
        ),
    ),
    "ReaperAckerLag": Runbook(
        means="An acker is more than 100,000 ack messages behind: batches of its schema complete late.",
        check=(
            "The `schema` label of `reaper_acker_lag_messages`: which schema's acker is behind (its consumer "
            "group is `acker.group`, or `<acker.group>-<ack_topic>` for another schema's ack topic).",
            "`reaper_ack_apply_duration_seconds`: is each apply slow (database load, lock waits)?",
            "That every instance runs its ackers (`acker.enabled`) and the ack topic's partitions are spread over them.",
        ),
        act=(
            "Relieve the database (slow queries, vacuum of the batch tables) or add instances, up to "
            "the number of the ack topic's partitions.",
        ),
    ),
    "ReaperLeaderFlapping": Runbook(
        means="Leadership changes again and again: every change republishes what was in flight "
        "(duplicates) and pauses publication for a moment.",
        check=(
            "The logs for fences (`no heartbeat within heartbeat_timeout`) or revocations (rebalances).",
            "CPU starvation or throttling of the reaper's container, and the brokers' latency.",
            "Instances restarting (their exit codes).",
        ),
        act=(
            "Give the reaper its CPU (requests and limits), or raise `harvester.heartbeat_timeout` "
            "(keep it below the group's session timeout).",
            "Fix the cause of the restarts.",
        ),
    ),
    "ReaperDeadRowsWaiting": Runbook(
        means="Rows have sat in the dead table for an hour: messages the applications committed have not reached Kafka.",
        check=("`reaper dead list`: the rows and why Kafka refused them.",),
        act=(
            "Fix the cause, then `reaper dead requeue --reason <text>` (or `--id`, `--all`) moves them "
            "back to the outbox once.",
        ),
    ),
    "ReaperBatchesExpired": Runbook(
        means="Batches saw no add, close or outcome for `sweeper.idle_expiry` and were expired: they "
        "will never complete. Their completion topic received an expiry event with the counts.",
        check=(
            "`reaper batch show <id>`: its pending items and failures.",
            "Whether a producer never closed its batch, or consumers stopped acking.",
        ),
        act=(
            "Fix the producer (close every batch) or the consumers; raise `sweeper.idle_expiry` if "
            "batches legitimately idle that long.",
        ),
    ),
}
