"""The calm-lanes test's canary rule: which fences the broker or the machine explains."""

from __future__ import annotations

from support.broker_canary import Probe, slow_for_everyone
from support.json_log import unix_time

HB = 5.0


def steady(start: float, end: float, latency: float = 0.01) -> list[Probe]:
    n = int((end - start) / 0.1)
    return [Probe(start + i * 0.1, start + i * 0.1 + latency) for i in range(n)]


def test_a_fence_while_the_canary_was_answered_promptly_is_not_explained():
    assert not slow_for_everyone(steady(0, 100), 50.0, HB)


def test_a_slow_acknowledgement_in_the_fence_window_explains_it():
    probes = steady(0, 100)
    probes[460] = Probe(probes[460].sent, probes[460].sent + HB / 2 + 0.1)  # sent at 46 s
    assert slow_for_everyone(probes, 50.0, HB)
    assert not slow_for_everyone(probes, 80.0, HB)  # long after it: the broker answered again


def test_a_record_never_acknowledged_explains_it():
    probes = steady(0, 100)
    probes[480] = Probe(probes[480].sent, None)
    assert slow_for_everyone(probes, 50.0, HB)


def test_a_canary_that_sent_nothing_for_long_explains_it():
    probes = [p for p in steady(0, 100) if not 45.0 <= p.sent <= 48.0]
    assert slow_for_everyone(probes, 50.0, HB)
    assert not slow_for_everyone(probes, 60.0, HB)


def test_structlog_timestamps_read_as_unix_time():
    assert unix_time("2026-11-27T11:31:32.559057Z") == 1795779092.559057
