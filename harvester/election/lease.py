"""One harvest unit's leadership lease, as harvester.election.neli's election keeps it and the marker reads it.

States: FOLLOWER (partition u not held), LEADER, FENCED (held, but no heartbeat came back in time).
The lease is valid, and the leader id given out, only while heartbeats come back within
`hb_timeout` of the time they were sent; a revocation waits for the marks on their way (`marking`).
`database` says how long the marker's database work has gone unanswered (harvester.election.step_down).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from harvester import logs
from harvester.metrics import MetricsLike

FOLLOWER, LEADER, FENCED = "follower", "leader", "fenced"
MARK_DEADLINE_MARGIN = 0.05  # seconds; clocks drift at most ~0.5 ms between re-anchorings


# How long a failed database operation stays evidence that the database is out of reach when no
# other operation follows it: longer than the marker's longest pause between attempts (its remark
# back-off, at most 5 s, then 0.2 s), so a cut that lasts keeps its run going. A marker that stops
# trying for other reasons (its throttle full while Kafka is slow) lets the run go stale instead
# of stepping down for a database that may be fine.
EVIDENCE_FRESH = 6.0


class DatabaseReach:
    """Since when one lease's database work has gone unanswered; written by the marker, read by the
    election thread (a few floats, each replaced whole).

    The run of failures starts with the first operation of it and lasts while an operation is on
    its way (a silent network holds it) or the last one failed less than EVIDENCE_FRESH ago; any
    answer ends it."""

    def __init__(self) -> None:
        self._since: float | None = None  # start of the oldest operation not followed by an answer
        self._pending = False  # an operation is on its way
        self._failed_at = 0.0  # when the last operation failed unanswered

    def attempt(self, now: float | None = None) -> None:
        """An operation begins (the first of a run of failures keeps its start; a run gone stale
        starts again)."""
        now = time.monotonic() if now is None else now
        if self._since is None or self._stale(now):
            self._since = now
        self._pending = True

    def answered(self) -> None:
        """The database answered (a result, or a refusal or SQL error of its own)."""
        self._since = None
        self._pending = False

    def failed(self, now: float | None = None) -> None:
        """The operation ended without an answer (a lost or refused connection, a checkout timeout)."""
        self._failed_at = time.monotonic() if now is None else now
        self._pending = False

    def unanswered_for(self, now: float) -> float:
        since = self._since
        if since is None or self._stale(now):
            return 0.0
        return max(0.0, now - since)

    def _stale(self, now: float) -> bool:
        """Nothing on its way and the last failure too old to count (see EVIDENCE_FRESH)."""
        return not self._pending and now - self._failed_at > EVIDENCE_FRESH


class Lease:
    """One unit's leadership: assigned (FOLLOWER until partition u is held) / LEADER / FENCED.

    `leader_id()` is computed from the clock when asked, not from the last state the polling
    thread saw: a process that was paused (SIGSTOP, a long stall) sees itself fenced at once.
    """

    def __init__(
        self, unit: int, hb_timeout: float, metrics: MetricsLike, on_change: Callable[[str, uuid.UUID | None], None]
    ) -> None:
        self.unit, self.hb_timeout, self._m = unit, hb_timeout, metrics
        self.on_change = on_change
        self._log = logs.get("reaper.neli")
        self._lock = threading.Lock()
        self._marks_done = threading.Condition(self._lock)
        self._marking = 0  # marks on their way (see marking())
        self._state = FOLLOWER
        self._leader_id: uuid.UUID | None = None
        self.holding = False
        self.last_heartbeat = 0.0  # monotonic SEND time of the newest own heartbeat read back
        self.last_sent = 0.0
        self.database = DatabaseReach()  # the marker's database answers (see harvester.election.step_down)

    @property
    def state(self) -> str:
        return self._state

    def leader_id(self) -> uuid.UUID | None:
        """The id to publish under, or None when not leading or already overdue for a heartbeat."""
        if self._state != LEADER:
            return None
        if time.monotonic() - self.last_heartbeat > self.hb_timeout:
            return None
        return self._leader_id

    def valid_until(self) -> float:
        """Monotonic time after which the current leadership is void unless a heartbeat returns."""
        return self.last_heartbeat + self.hb_timeout if self._state == LEADER else 0.0

    def marks_accepted_until(self) -> float:
        """Monotonic time after which the database refuses every mark already on its way, whatever
        the state is now: each mark read valid_until() before its lease check, last_heartbeat only
        grows, and the database clock's mapping lands early (harvester.election.db_clock) but for
        its drift, which MARK_DEADLINE_MARGIN covers many times over."""
        return self.last_heartbeat + self.hb_timeout + MARK_DEADLINE_MARGIN

    def end_marks_or_deadline(self, first_until: float, on_late: Callable[[], None]) -> None:
        """Wait for the marks on their way until `first_until`; if one is still out then, call
        `on_late` and wait for it until the database can no longer accept it: a partition let go
        earlier could see a late mark take rows the next leader is publishing."""
        if not self.end_marks(max(0.0, first_until - time.monotonic())):
            on_late()
            self.end_marks(max(0.0, self.marks_accepted_until() - time.monotonic()))

    @contextmanager
    def marking(self) -> Iterator[uuid.UUID | None]:
        """Held by the marker from its lease check until its mark statement has returned; yields the
        leader id, or None (mark nothing). A revocation (`end_marks`) lets the partition go only once
        no mark is on its way, so a unit handed to another reaper by a rebalance is never marked by
        this one after the other started. (A lease that merely expires is bounded by the database
        itself: OutboxStore.mark's `until`.)"""
        with self._marks_done:
            leader_id = self.leader_id()  # lock-free: the lock is not re-entrant
            if leader_id is not None:
                self._marking += 1
        try:
            yield leader_id
        finally:
            if leader_id is not None:
                with self._marks_done:
                    self._marking -= 1
                    self._marks_done.notify_all()

    def end_marks(self, timeout: float) -> bool:
        """After leadership ended: wait up to `timeout` for marks on their way; True once none is."""
        with self._marks_done:
            return self._marks_done.wait_for(lambda: self._marking == 0, timeout)

    def set(self, state: str, leader_id: uuid.UUID | None) -> None:
        with self._lock:
            if state == self._state and leader_id == self._leader_id:
                return
            self._state, self._leader_id = state, leader_id
        self._m.leader.set(1 if state == LEADER else 0)
        self._log.info(f"neli {state}", state=state, unit=self.unit, leader_id=str(leader_id) if leader_id else None)
        self.on_change(state, leader_id)

    def acquire(self, resumed: bool = False) -> None:
        if not resumed:  # partition just assigned: a heartbeat timeout's grace from now
            self.last_heartbeat = time.monotonic()
        # (resumed: valid from the send time of the heartbeat that ended the fence, no longer)
        self.last_sent = 0.0
        self.database.answered()  # a failure of an earlier leadership does not count against this one
        self._m.acquisitions.inc()
        self.set(LEADER, uuid.uuid4())
