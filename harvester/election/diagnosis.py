"""Saying why the election is not getting anywhere: a unit fenced for long, an election thread that stopped.

A fence is meant to be brief: a leader whose heartbeats come back steadily resumes
(harvester.election.resumption), one whose partition moved is revoked, one whose consumer fell out
of the group gets a new consumer. A unit still fenced after REPORT_SESSIONS session timeouts is
reported, and again every as many, with what its resumption waits for: the age of the newest
heartbeat the broker acknowledged, how many heartbeats the producer still holds, the last error a
heartbeat's delivery report gave, whether the leader consumer is in the group, the steady run so
far and any stall grace still pending. Without that a fence that never ended left nothing in the
log after "neli fenced".

An election thread that stopped pulsing altogether (blocked in a callback or in a client call)
says nothing of itself, so a watchdog thread reports it, with the stack it is blocked in, once it
has not pulsed for REPORT_SESSIONS session timeouts, and again every as many. A watchdog that
itself woke late by as much saw a pause of the whole process (SIGSTOP, a VM pause), not a blocked
thread, and says nothing; nor does it while the thread waits for its database on purpose
(harvester.election.step_down).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable

from confluent_kafka import KafkaError

from harvester import logs
from harvester.election.lease import Lease
from harvester.election.resumption import Resumption

REPORT_SESSIONS = 3  # session timeouts of no progress before a report, and between two reports
STACK_FRAMES = 12  # innermost frames of a blocked election thread's stack in its report


class FencedReports:
    """When each unit's long fence is reported next, and the heartbeats' last delivery errors.
    Driven by the election thread only."""

    def __init__(self, units: int, every: float) -> None:
        self.every = every
        self._log = logs.get("reaper.neli")
        self._next = [0.0] * units  # monotonic: the unit's next report, for its current fence
        self._fence_started = [0.0] * units
        self.last_error: list[str | None] = [None] * units  # the last heartbeat delivery error, if any
        self.errors = [0] * units  # heartbeat delivery errors since the start
        self.failed_at = 0.0  # monotonic: the last heartbeat delivery error, of any unit
        self.acks = [0] * units  # heartbeats back (acknowledged or read back) since the last report
        self.last_trip: list[float | None] = [None] * units  # seconds from send to back, of the last one

    def failed(self, unit: int, err: KafkaError) -> None:
        if 0 <= unit < len(self.errors):
            self.errors[unit] += 1
            self.last_error[unit] = err.str()
            self.failed_at = time.monotonic()

    def back(self, unit: int, trip: float) -> None:
        """A heartbeat of `unit` came back `trip` seconds after it was sent."""
        self.acks[unit] += 1
        self.last_trip[unit] = trip

    def take_acks(self, unit: int) -> int:
        """The heartbeats back since the fence or the last report, counting anew from here."""
        count, self.acks[unit] = self.acks[unit], 0
        return count

    def due(self, unit: int, fenced_at: float, now: float) -> bool:
        """True when the fence that began at `fenced_at` has lasted long enough for (another) report."""
        if self._fence_started[unit] != fenced_at:
            self._fence_started[unit], self._next[unit] = fenced_at, fenced_at + self.every
            self.acks[unit] = 0
        if now < self._next[unit]:
            return False
        self._next[unit] = now + self.every
        return True

    def report(
        self,
        lease: Lease,
        resumption: Resumption,
        now: float,
        *,
        in_group: bool,
        unanswered: int | None,
        grace_left: float,
    ) -> None:
        """Log why `lease`, fenced for long, does not resume. `unanswered`: the heartbeats the
        election's producer still holds; `grace_left`: seconds of stall grace still pending."""
        unit, age, trip = lease.unit, now - lease.last_heartbeat, self.last_trip[lease.unit]
        self._log.warning(
            "still fenced: not resuming",
            unit=unit,
            why=why_not_resuming(
                heartbeat_age=age,
                fresh=resumption.fresh,
                grace_left=grace_left,
                in_group=in_group,
                steady=resumption.steady_for(),
                needed=resumption.needed,
            ),
            fenced_s=round(now - resumption.fenced_at, 1),
            heartbeat_age_s=round(age, 1),
            heartbeats_back=self.take_acks(unit),  # acknowledged or read back, since the fence or the last report
            last_round_trip_s=None if trip is None else round(trip, 3),
            heartbeats_unanswered=unanswered,
            heartbeat_errors=self.errors[unit],
            last_heartbeat_error=self.last_error[unit],
            in_group=in_group,
            steady_s=round(resumption.steady_for(), 3),
            steady_needed_s=resumption.needed,
            stall_grace_left_s=round(grace_left, 3),
        )


def why_not_resuming(
    *, heartbeat_age: float, fresh: float, grace_left: float, in_group: bool, steady: float, needed: float
) -> str:
    """The first condition of a resumption (see Neli._beat) that a fenced unit does not meet."""
    if not in_group:
        return "the leader consumer has no group member id"
    if heartbeat_age > fresh:
        return "no heartbeat acknowledged recently"
    if grace_left > 0:
        return "waiting out the grace after a stall of this process"
    if steady < needed:
        return "heartbeats back, not yet steady for long enough"
    return "ready to resume at the next pulse"


class Watchdog:
    """Reports an election thread that has not pulsed for `every` seconds (see the module docstring)."""

    def __init__(
        self,
        target: threading.Thread,
        last_pulse: Callable[[], float],
        waiting_on_purpose: Callable[[], bool],
        every: float,
        stop: threading.Event,
    ) -> None:
        self._target, self._last_pulse, self._on_purpose = target, last_pulse, waiting_on_purpose
        self.every, self._stop = every, stop
        self._log = logs.get("reaper.neli")
        self._check = min(1.0, every / 4)  # how often it looks
        self.reports = 0
        self._thread = threading.Thread(target=self._run, name="reaper-neli-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def check(self, now: float, woke_late_by: float, reported_at: float) -> bool:
        """Whether to report at `now` (the last report was at `reported_at`)."""
        if woke_late_by > self.every or self._on_purpose():
            return False  # the whole process was paused, or the thread waits for its database
        silent = now - self._last_pulse()
        return silent > self.every and now - reported_at > self.every

    def _run(self) -> None:
        reported_at, expected = 0.0, time.monotonic() + self._check
        while not self._stop.wait(self._check):
            now = time.monotonic()
            late, expected = now - expected, now + self._check
            if not self.check(now, late, reported_at):
                continue
            reported_at = now
            self.reports += 1
            frame = sys._current_frames().get(self._target.ident or -1)
            stack = traceback.format_stack(frame)[-STACK_FRAMES:] if frame is not None else []
            self._log.warning(
                "the election thread has not pulsed for long: blocked",
                silent_s=round(now - self._last_pulse(), 1),
                stack="".join(stack),
            )
