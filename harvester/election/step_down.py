"""Stepping down while this reaper alone cannot reach its database.

A leader cut off from Postgres but not from Kafka keeps its leader-topic partitions: its
heartbeats come back, so nothing in the election moves them, and publishing stops for as long as
the cut lasts although other reapers may reach Postgres. So the marker reports each database
operation of a lease (harvester.election.lease.DatabaseReach: a mark, the claim, the lease's
reading of the database clock, the pool checkout before them) and the election thread steps down
once every unit this process leads has gone without a database answer for
`harvester.step_down_after`: it fences those
leases first (publishing stops, as on missed heartbeats), lets the marks on their way return (or
waits out their deadlines, see `leave`), then leaves the leader group, so the partitions move to
another member at once. It joins again, as an ordinary member, only once a cheap probe through
each stepped-down unit's pool is answered by a server that takes writes
(harvester.db_pool.probe_writable): it is not elected again while cut off. Probes are spaced PROBE_FIRST, doubling to
PROBE_MAX, so a reaper that is the only member waits for Postgres without spinning.

An answer ends a run of failures, even a refusal (a mark refused as late, a table held by another
layout, an SQL error): the database was reached. An operation still waiting for its answer counts
as unanswered from its start: a silent network holds a statement until the TCP liveness settings
(harvester.db_liveness) break it, and a checkout waits for the pool's timeout.

Stepping down leaves the group for every unit of this process: one consumer serves them all, and
a member cannot hand back one partition of its own accord. That is why every led unit must be cut
off first: a database gone for every reaper (units on several DSNs) does not empty the group of
the members that still publish the other units.

Nor does a leader step down when no other member is in the group (a lone reaper, or the last one
of several that all lost the same database): there is no one to hand over to, and leaving would
only delay its own return, since a consumer joining an empty group waits out the broker's
group.initial.rebalance.delay.ms (3 s by default) before it is given a partition. It keeps its
partitions, and its marks resume as soon as Postgres answers, as before stepping down existed; the
group is looked at again every `after` while the cut lasts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial

from confluent_kafka.admin import AdminClient
from prometheus_client import Counter

from harvester import logs
from harvester.election.lease import FENCED, FOLLOWER, LEADER, Lease

PROBE_FIRST = 0.25  # seconds between the first probes of a stepped-down reaper
PROBE_MAX = 1.0  # bound of the doubling: the rejoin follows Postgres's return within about this
PROBE_TIMEOUT = 1.0  # seconds one probe waits for a pool connection


class StepDown:
    """When the election steps down, and how it waits to rejoin. `probe(unit, timeout)` raises
    unless unit's database answers; `after` 0 never steps down."""

    def __init__(self, after: float, probe: Callable[[int, float], None], counter: Counter | None = None) -> None:
        self.after, self._probe, self._counter = after, probe, counter
        self._log = logs.get("reaper.neli")
        self._alone_until = 0.0  # monotonic: found alone in the group; not looked at again before this

    def anyone_to_hand_over_to(self, now: float, others: Callable[[], int | None]) -> bool:
        """Whether stepping down hands the partitions to someone: `others()` counts the group's
        other members (None: unknown, taken as yes). Asked at most once per `after` while alone."""
        if now < self._alone_until:
            return False
        count = others()
        if count == 0:
            self._alone_until = now + self.after
            self._log.warning("database out of reach, but no other member to hand over to: keeping the partitions")
            return False
        return True

    def due(self, leases: Sequence[Lease], now: float) -> list[Lease]:
        """The held leases to step down from: all of them when each leads and has had no database
        answer for `after`; otherwise none."""
        held = [lease for lease in leases if lease.holding]
        if self.after <= 0 or not held:
            return []
        if all(lease.state == LEADER and lease.database.unanswered_for(now) > self.after for lease in held):
            return held
        return []

    def leave(
        self,
        held: Sequence[Lease],
        now: float,
        wait_marks: float,
        leave_group: Callable[[], None],
        stop: threading.Event,
    ) -> None:
        """Fence every held lease, as a missed heartbeat does, let the marks on their way return (up to
        `wait_marks` in all; a mark still out after that, until its deadline has passed),
        `leave_group`, and wait until the leases' databases answer or `stop`."""
        self._log.warning(
            "database out of reach while Kafka is not: fencing and leaving the leader group",
            units=[lease.unit for lease in held],
            unanswered_s=round(min(lease.database.unanswered_for(now) for lease in held), 3),
            step_down_after=self.after,
        )
        if self._counter is not None:
            self._counter.inc()
        for lease in held:
            lease.set(FENCED, None)
        deadline = time.monotonic() + wait_marks
        for lease in held:
            # Leaving hands the partition over at once, unlike a missed heartbeat (whose session
            # timeout outlasts every deadline): a mark still waiting (for a connection, most
            # likely) would be accepted until its own deadline (OutboxStore.mark's `until`).
            lease.end_marks_or_deadline(
                deadline,
                partial(
                    self._log.warning,
                    "stepping down with a mark still on its way: waiting out its deadline",
                    unit=lease.unit,
                ),
            )
            lease.holding = False
        try:
            leave_group()
        except Exception as exc:
            self._log.warning("leader consumer close failed", error=str(exc))
        for lease in held:
            lease.set(FOLLOWER, None)
        self.wait_for_database([lease.unit for lease in held], stop)

    def wait_for_database(self, units: Sequence[int], stop: threading.Event) -> bool:
        """Probe each of `units`' databases until all answer (True), with a back-off, or until `stop` (False)."""
        started, pause, probes = time.monotonic(), PROBE_FIRST, 0
        pending = list(units)
        while not stop.is_set():
            probes += 1
            try:
                while pending:
                    self._probe(pending[0], PROBE_TIMEOUT)
                    pending.pop(0)
            except Exception as exc:
                if probes == 1:
                    self._log.info("database still out of reach: probing", error=type(exc).__name__)
                if stop.wait(pause):
                    return False
                pause = min(pause * 2, PROBE_MAX)
                continue
            self._log.info(
                "database answers again: rejoining the leader group",
                units=list(units),
                stepped_down_s=round(time.monotonic() - started, 3),
                probes=probes,
            )
            return True
        return False


def other_members(admin: AdminClient, group: str, me: str | None, timeout: float) -> int | None:
    """How many members of consumer group `group` are not `me`; None when the broker did not say."""
    try:
        described = admin.describe_consumer_groups([group], request_timeout=timeout)[group].result(timeout)
    except Exception:
        return None
    return sum(1 for member in described.members if member.member_id != me)
