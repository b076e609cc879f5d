"""tolerated_failure_ratio=r finishes a closed batch early once MORE than r of its items failed,
decided in exact decimal arithmetic: exactly r (29 of 100 at 0.29) is within it. In float8,
0.29 * 100 is 28.999999999999996 and a batch at exactly its ratio finished early, its pending items
counted failed."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracker


@st.composite
def cases(draw) -> tuple[int, int, int]:
    n = draw(st.integers(1, 200))
    return n, draw(st.integers(0, 100)), draw(st.integers(1, n))


@settings(max_examples=60, suppress_health_check=list(HealthCheck), deadline=None)
@given(case=cases())
def test_a_closed_batch_finishes_early_exactly_when_more_than_its_ratio_failed(conn, schema, case):
    n, percent, failed = case
    ratio = percent / 100
    b = tracker.open_batch(conn, tolerated_failure_ratio=ratio, schema=schema)
    (g,) = tracker.add_items(conn, b, n, schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    r = tracker.fail(conn, f"{b.id}:{g.group_id}:0-{failed - 1}", "bad row", schema=schema)
    conn.commit()
    beyond = Fraction(failed, n) > Fraction(percent, 100)
    s = tracker.status(conn, b, schema=schema)
    if beyond or failed == n:
        assert (s.state, s.outcome, r.completed) == ("complete", "failed", [b.id]), (case, s)
    else:
        assert (s.state, r.completed) == ("closed", []), (case, s)


def test_the_ratios_that_float_arithmetic_got_wrong(conn, schema):
    for ratio, n in [(0.29, 100), (0.57, 100), (0.58, 100), (0.07, 200)]:
        failed = round(ratio * n)
        b = tracker.open_batch(conn, tolerated_failure_ratio=ratio, schema=schema)
        (g,) = tracker.add_items(conn, b, n, schema=schema)
        tracker.close_batch(conn, b, schema=schema)
        tracker.fail(conn, f"{b.id}:{g.group_id}:0-{failed - 1}", "bad row", schema=schema)
        conn.commit()
        assert tracker.status(conn, b, schema=schema).state == "closed", (ratio, n)
