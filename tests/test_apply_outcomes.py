"""`Tracker.apply_outcomes`: folded steps of acks and failures (the acker's poll) applied in order
in two round trips, with the results and refusals `apply_masks` / `fail_masks` give one by one."""

from __future__ import annotations

import psycopg
import pytest
from test_tracker_support import invariant_violations

import tracker
from tracker.errors import InvalidValue, UnknownGroup


def closed_batch(conn: psycopg.Connection, schema: str, n: int) -> tracker.Batch:
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, n, schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    return b


def ids(b: tracker.Batch, *indexes: int) -> list[str]:
    return [f"{b.id}:0:{i}" for i in indexes]


def test_steps_apply_in_order_and_the_first_outcome_of_an_item_wins(conn, schema):
    b = closed_batch(conn, schema, 6)
    steps = [
        (None, tracker.fold(ids(b, 0, 1))),
        ("timeout", tracker.fold(ids(b, 1, 2, 3))),  # 1 was acked by the step before: a duplicate
        ("bad input", tracker.fold(ids(b, 4))),
        (None, tracker.fold(ids(b, 2, 5))),  # 2 failed in the step before: a duplicate
    ]
    results = tracker.apply_outcomes(conn, steps, schema=schema)
    conn.commit()
    assert [(r.acked, r.duplicates) for r in results] == [(2, 0), (2, 1), (1, 0), (1, 1)]
    assert [r.completed for r in results] == [[], [], [], [b.id]]
    s = tracker.status(conn, b, schema=schema)
    assert (s.state, s.succeeded, s.failed, s.pending, s.outcome) == ("complete", 3, 3, 0, "failed")
    page = tracker.failures(conn, b, schema=schema)
    assert page.items == [(ids(b, 2)[0], "timeout"), (ids(b, 3)[0], "timeout"), (ids(b, 4)[0], "bad input")]
    assert invariant_violations(conn, schema) == []


def test_the_same_as_apply_masks_and_fail_masks_one_by_one(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        one, two = closed_batch(c, schema, 9), closed_batch(c, schema, 9)
        for b, by_steps in ((one, False), (two, True)):
            steps = [
                ("r1", tracker.fold(ids(b, 0, 1, 2))),
                (None, tracker.fold(ids(b, 2, 3, 4, 0))),
                ("r2", tracker.fold(ids(b, 5, 6, 4))),
                ("r1", tracker.fold(ids(b, 7, 8))),
            ]
            if by_steps:
                got = tracker.apply_outcomes(c, steps, reject_invalid=True, schema=schema)
            else:
                got = [
                    tracker.apply_masks(c, m, reject_invalid=True, schema=schema)
                    if r is None
                    else tracker.fail_masks(c, m, r, reject_invalid=True, schema=schema)
                    for r, m in steps
                ]
            c.commit()
            if not by_steps:
                want = got
        assert [(r.acked, r.duplicates, r.completed != []) for r in got] == [
            (r.acked, r.duplicates, r.completed != []) for r in want
        ]
        a, b = (tracker.status(c, x, schema=schema) for x in (one, two))
        assert (a.succeeded, a.failed, a.pending, a.outcome) == (b.succeeded, b.failed, b.pending, b.outcome)
        strip = lambda page: [(i.split(":", 1)[1], r) for i, r in page.items]  # noqa: E731
        assert strip(tracker.failures(c, one, schema=schema)) == strip(tracker.failures(c, two, schema=schema))
        assert invariant_violations(c, schema) == []


def test_a_batch_held_elsewhere_is_skipped_in_every_step(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c, psycopg.connect(pg_dsn) as holder:
        held, free = closed_batch(c, schema, 4), closed_batch(c, schema, 4)
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [held.id])
        steps = [
            (None, tracker.fold(ids(free, 0) + ids(held, 0))),
            ("timeout", tracker.fold(ids(held, 1) + ids(free, 1))),
            (None, tracker.fold(ids(held, 2))),
        ]
        results = tracker.apply_outcomes(c, steps, reject_invalid=True, skip_locked=True, schema=schema)
        c.commit()
        assert [sorted(r.skipped) for r in results] == [[(held.id, 0)]] * 3
        assert [r.acked for r in results] == [1, 1, 0]
        holder.rollback()
        s = tracker.status(c, held, schema=schema)
        assert (s.succeeded, s.failed, s.pending) == (0, 0, 4)


def test_bad_input_is_refused_before_anything_is_applied(conn, schema):
    b = closed_batch(conn, schema, 3)
    with pytest.raises(InvalidValue):
        tracker.apply_outcomes(conn, [(None, tracker.fold(ids(b, 0))), ("", tracker.fold(ids(b, 1)))], schema=schema)
    with pytest.raises(UnknownGroup):
        tracker.apply_outcomes(
            conn, [(None, tracker.fold(ids(b, 0))), ("x", tracker.fold([f"{b.id}:7:0"]))], schema=schema
        )
    conn.rollback()
    assert tracker.status(conn, b, schema=schema).pending == 3
    results = tracker.apply_outcomes(
        conn,
        [(None, tracker.fold(ids(b, 0))), ("x", tracker.fold([f"{b.id}:7:0"]))],
        reject_invalid=True,
        schema=schema,
    )
    assert results[0].acked == 1 and results[1].rejected == [(f"{b.id}:7:0", "unknown group")]
