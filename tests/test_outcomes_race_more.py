"""More races of the paths that finish a batch (see test_outcomes_race): a claims ack settled at
commit racing a failure of the batch's other last item; a grandchild's final ack racing its
grandparent's close; the claim settle (tracker.settle) finishing a child racing its parent's close."""

from __future__ import annotations

import random

import psycopg
import pytest
from test_outcomes_race import _claim, _close, _fail, check, race, setup  # noqa: F401 (fixture)

import tracker
from tracker.settle import settle

ROUNDS = 20


def test_claims_ack_at_commit_races_failure_of_the_other_last_item(pg_dsn, schema, setup):  # noqa: F811
    conn, make = setup
    rng = random.Random("claims-vs-fail")
    for _ in range(ROUNDS):
        b = make(2)
        race(pg_dsn, _claim(schema, [f"{b}:0:0"]), _fail(schema, [f"{b}:0:1"]), rng)
        # a claim whose commit-time settle found the failure holding the batch waits for the next
        # settle (the reaper's loop): run it, as the loop would
        settle(conn, [b], schema=schema, registry=None)
        conn.commit()
        check(conn, schema, [b])
        s = tracker.status(conn, b, schema=schema)
        assert (s.state, s.outcome, s.pending, s.failed) == ("complete", "failed", 0, 1)


def test_grandchilds_final_ack_races_grandparents_close(pg_dsn, schema, setup):  # noqa: F811
    conn, make = setup
    rng = random.Random("grandchild-vs-close")
    for k in range(ROUNDS):
        g = make(close=False)
        p = make(close=False, parent=g)
        c = make(1, parent=p)
        tracker.close_batch(conn, p, schema=schema)
        conn.commit()
        path = _claim if k % 2 else (lambda s, ids: _fail(s, ids))
        race(pg_dsn, path(schema, [f"{c}:0:0"]), _close(schema, g), rng)
        check(conn, schema, [g, p, c])


@pytest.mark.parametrize("wait", [False, True])
def test_settle_finishing_a_child_races_its_parents_close(pg_dsn, schema, setup, wait):  # noqa: F811
    conn, make = setup
    rng = random.Random(f"settle-vs-close-{wait}")
    for _ in range(ROUNDS):
        p = make(close=False)
        c = make(1, parent=p)
        # a claim committed while someone held the child: left for a later settle
        conn.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [c])
        with psycopg.connect(pg_dsn) as other:
            tracker.ack(other, [f"{c}:0:0"], schema=schema)
            other.commit()
        conn.rollback()

        def settle(cn):
            return cn.execute(
                f'SELECT * FROM "{schema}".ack_settle(%s, %s::regclass, %s, %s)',
                [c, f'"{schema}".outbox', "batch-completions", wait],
            ).fetchone()

        race(pg_dsn, settle, _close(schema, p), rng)
        check(conn, schema, [p, c])
