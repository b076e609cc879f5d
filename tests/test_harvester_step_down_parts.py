"""StepDown with real leases: when the group may be left, and what counts as the database answering.

No service is involved: the leases are the election's own objects, the marks are threads holding
`Lease.marking()` as the marker does around its statement.
"""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harvester.election.lease import EVIDENCE_FRESH, FOLLOWER, DatabaseReach, Lease
from harvester.election.step_down import StepDown
from harvester.metrics import get as get_metrics
from harvester.publishing.mark_purge_reset import MAX_REMARK_BACKOFF

HB_TIMEOUT = 1.5


def _leading(unit: int = 0) -> Lease:
    lease = Lease(unit, HB_TIMEOUT, get_metrics(), on_change=lambda state, leader_id: None)
    lease.holding = True
    lease.acquire()  # valid until HB_TIMEOUT from now unless a heartbeat returns
    return lease


def _hung_mark(lease: Lease, release: threading.Event) -> tuple[threading.Thread, list[float]]:
    """A mark on its way that does not return (a silent network): its deadline is read before the
    lease check, as UnitHarvester._mark_loop reads it."""
    entered = threading.Event()
    deadline: list[float] = []

    def mark() -> None:
        deadline.append(lease.valid_until())
        with lease.marking() as leader_id:
            assert leader_id is not None
            entered.set()
            release.wait(30)

    t = threading.Thread(target=mark, daemon=True)
    t.start()
    assert entered.wait(10)
    return t, deadline


def test_the_group_is_left_only_once_a_hung_mark_can_no_longer_be_accepted():
    """Leaving the group hands the partition to another reaper at once (no session timeout to wait
    out, unlike a missed heartbeat). A mark still on its way may reach the database late and is
    accepted there until its deadline: the old leader would then mark rows the new leader is
    already publishing (the per-key order is lost). So the group is left only once every mark has
    returned or its deadline has passed."""
    lease = _leading()
    release = threading.Event()
    marker, deadline = _hung_mark(lease, release)
    left_at: list[float] = []
    try:
        StepDown(1.0, probe=lambda unit, timeout: None).leave(
            [lease],
            time.monotonic(),
            wait_marks=0.05,
            leave_group=lambda: left_at.append(time.monotonic()),
            stop=threading.Event(),
        )
    finally:
        release.set()
        marker.join(10)
    assert left_at, "the group was never left"
    assert left_at[0] >= deadline[0], "left the group while a mark on its way could still be accepted"
    assert lease.state == FOLLOWER and not lease.holding


def test_a_mark_that_returns_lets_the_group_be_left_at_once():
    """The wait for a hung mark's deadline is not paid when the marks come back: no mark, no wait."""
    lease = _leading()
    left_at: list[float] = []
    StepDown(1.0, probe=lambda unit, timeout: None).leave(
        [lease],
        time.monotonic(),
        wait_marks=0.05,
        leave_group=lambda: left_at.append(time.monotonic()),
        stop=threading.Event(),
    )
    assert left_at and lease.state == FOLLOWER


def test_a_leader_alone_in_the_group_keeps_its_partitions_and_looks_again_after_step_down_after():
    """Alone, leaving hands nothing over; the group is asked once per `after`, and a broker that
    does not answer is taken as someone being there (the step-down goes ahead)."""
    asked: list[int] = []

    def alone() -> int:
        asked.append(0)
        return 0

    step = StepDown(2.0, probe=lambda unit, timeout: None)
    assert not step.anyone_to_hand_over_to(100.0, alone)
    assert not step.anyone_to_hand_over_to(101.0, alone)
    assert len(asked) == 1
    assert step.anyone_to_hand_over_to(102.5, lambda: 1)
    assert StepDown(2.0, probe=lambda unit, timeout: None).anyone_to_hand_over_to(100.0, lambda: None)


# ---------------------------------------------------------------- what counts as a run of failures

EVENTS = st.lists(
    st.tuples(st.sampled_from(["attempt", "answered", "failed"]), st.floats(0.0, 8.0, allow_nan=False)),
    max_size=30,
)


@given(EVENTS, st.floats(0.0, 20.0, allow_nan=False))
def test_a_run_of_failures_is_counted_from_its_first_operation_while_its_evidence_is_fresh(events, wait):
    """A model of the rule: the run starts with the first operation after an answer (or after the
    run went stale) and counts while an operation is on its way or the last one failed less than
    EVIDENCE_FRESH ago."""
    reach, now = DatabaseReach(), 1000.0
    since, pending, failed_at = None, False, -1e9
    for kind, gap in events:
        now += gap
        if kind == "attempt":
            reach.attempt(now)
            if since is None or (not pending and now - failed_at > EVIDENCE_FRESH):
                since = now
            pending = True
        elif kind == "answered":
            reach.answered()
            since, pending = None, False
        elif pending:  # the marker reports a failure only for an operation it began
            reach.failed(now)
            failed_at, pending = now, False
    now += wait
    fresh = pending or now - failed_at <= EVIDENCE_FRESH
    expected = 0.0 if since is None or not fresh else now - since
    assert reach.unanswered_for(now) == pytest.approx(expected)


def test_a_failure_the_marker_does_not_follow_up_goes_stale():
    """One failed mark, then no attempt (the throttle full while Kafka is slow): no step-down for a
    database that may well be fine; and a later failure starts a new run rather than continuing it."""
    reach = DatabaseReach()
    reach.attempt(0.0)
    reach.failed(0.1)
    assert reach.unanswered_for(EVIDENCE_FRESH) == pytest.approx(EVIDENCE_FRESH)
    assert reach.unanswered_for(EVIDENCE_FRESH + 0.2) == 0.0
    reach.attempt(30.0)
    reach.failed(30.1)
    assert reach.unanswered_for(31.0) == pytest.approx(1.0)


def test_a_cut_that_lasts_keeps_its_run_through_the_markers_longest_pause():
    """The marker's longest pause between two marks (its remark back-off, then its retry wait) is
    shorter than EVIDENCE_FRESH: a database that stays out of reach keeps one run going."""
    assert MAX_REMARK_BACKOFF + 0.2 < EVIDENCE_FRESH
    reach, now = DatabaseReach(), 0.0
    for _ in range(5):
        reach.attempt(now)
        reach.failed(now + 0.1)
        now += 0.1 + MAX_REMARK_BACKOFF + 0.2
    assert reach.unanswered_for(now) == pytest.approx(now)


def test_an_operation_on_its_way_counts_however_long_it_waits():
    reach = DatabaseReach()
    reach.attempt(0.0)
    assert reach.unanswered_for(3600.0) == pytest.approx(3600.0)
    reach.answered()
    assert reach.unanswered_for(3601.0) == 0.0


class _Pauses(threading.Event):
    """A stop event whose waits return at once and are recorded: the back-off without the clock."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(timeout or 0.0)
        return self.is_set()


@given(st.integers(min_value=0, max_value=12), st.integers(min_value=1, max_value=3))
def test_a_stepped_down_reaper_probes_with_a_doubling_pause_and_each_unit_until_it_answers(failures, units):
    asked: list[int] = []

    def probe(unit: int, timeout: float) -> None:
        asked.append(unit)
        if len(asked) <= failures:
            raise ConnectionRefusedError("cut off")

    stop = _Pauses()
    assert StepDown(10.0, probe).wait_for_database(list(range(units)), stop)
    expected = [0.25, 0.5, 1.0] + [1.0] * failures
    assert stop.waits == expected[:failures]  # one pause per failed probe, doubling up to a second
    # A unit that answered is not asked again; the one that failed is asked until it answers.
    assert asked == [0] * (failures + 1) + list(range(1, units))


def test_a_stop_while_cut_off_ends_the_probing():
    stop = _Pauses()

    def probe(unit: int, timeout: float) -> None:
        if len(stop.waits) == 2:
            stop.set()  # the reaper is told to stop while Postgres is still away
        raise ConnectionRefusedError("cut off")

    assert not StepDown(10.0, probe).wait_for_database([0], stop)
    assert stop.waits == [0.25, 0.5, 1.0]
