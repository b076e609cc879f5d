"""The resumption rule of a fenced lease (harvester.election.resumption), on a clock driven by hand.

The election that applies it runs against real Kafka in test_harvester_neli_flapping.py; here the
rule's edges: the run is counted on send times, a stale heartbeat breaks it, a flap doubles the
next wait up to its bound, and a calm leadership resets it.
"""

from __future__ import annotations

from harvester.election.resumption import FRESH, MAX_STEADY_FACTOR, Resumption

HB = 5.0


def _pulses(r: Resumption, start: float, seconds: float, age: float, step: float = 0.05) -> float | None:
    """Heartbeats `age` old at every pulse from `start` on; the time it became ready, or None."""
    t = start
    while t <= start + seconds:
        if r.ready(t, t - age, True):
            return t
        t += step
    return None


def test_heartbeats_back_in_time_for_the_steady_period_resume():
    r = Resumption(1.0, 15.0, HB)
    r.fenced(100.0)
    at = _pulses(r, 110.0, 5.0, age=0.1)
    assert at is not None and 1.0 <= at - 110.0 < 1.1


def test_a_brief_reopening_proves_nothing_after_its_last_heartbeat():
    r = Resumption(1.0, 15.0, HB)
    r.fenced(100.0)
    assert _pulses(r, 110.0, 0.5, age=0.05) is None  # back for half the steady period
    newest = 110.5 - 0.05
    # then nothing more comes back: the lease stays valid a while, but the run does not grow
    t = 110.5
    while t < 110.5 + FRESH * HB:
        assert not r.ready(t, newest, True), t
        t += 0.05


def test_late_heartbeats_never_add_up_to_a_run():
    r = Resumption(1.0, 15.0, HB)
    r.fenced(100.0)
    assert _pulses(r, 110.0, 10.0, age=0.9 * HB) is None  # each one leaves a lease of half a second


def test_a_pending_stall_grace_breaks_the_run():
    r = Resumption(1.0, 15.0, HB)
    r.fenced(100.0)
    assert not r.ready(110.0, 110.0, True)
    assert not r.ready(110.6, 110.6, False)
    assert not r.ready(111.0, 111.0, True)  # counted again from 111.0
    assert r.ready(112.0, 112.0, True)


def test_fencing_soon_after_resuming_doubles_the_wait_up_to_its_bound_and_a_calm_term_resets_it():
    r = Resumption(1.0, 15.0, HB)
    r.fenced(100.0)
    assert r.needed == 1.0
    t = 100.0
    for expected in (2.0, 4.0, 4.0):
        r.resumed(t)
        r.fenced(t + 1.0)  # a flap
        assert r.needed == expected
        t += 10.0
    assert expected == MAX_STEADY_FACTOR * 1.0
    r.resumed(t)
    r.fenced(t + 16.0)  # a term longer than the flap window
    assert r.needed == 1.0
    r.resumed(t + 20.0)
    r.acquired()
    r.fenced(t + 21.0)  # a new assignment forgets the resumption before it
    assert r.needed == 1.0


def test_zero_resumes_at_the_first_heartbeat_back_within_the_timeout():
    r = Resumption(0.0, 15.0, HB)
    r.fenced(100.0)
    assert r.ready(110.0, 110.0 - 0.95 * HB, True)
    r.resumed(110.0)
    r.fenced(110.5)
    assert r.needed == 0.0
