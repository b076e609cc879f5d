"""Races of every new path that can finish a batch, on real Postgres: two threads (own connections,
own transactions) released together after a random short delay each, many rounds. Every round
ends with exactly one event per batch (never two; none missing once the settle that follows every
round, as the reaper's settler loop would, has folded finished children into their parents), no
error and no deadlock:

  * a child's final ack racing its parent's close;
  * two children's final acks at once (their parent, closed, waits for both);
  * a final failure racing a final ack (of other items, and of the same item);
  * a failure crossing a threshold racing a close;
  * a child expiring racing its parent's close.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from test_tracker_support import invariant_violations

import tracker
from tracker.expiry import expire_batch

ROUNDS = 40

Action = Callable[[psycopg.Connection], object]


def race(dsn: str, first: Action, second: Action, rng: random.Random) -> list[object]:
    """Run both actions at once, each in its own committed transaction; their results (or errors)."""
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def run(k: int, action: Action) -> None:
        with psycopg.connect(dsn) as conn:
            barrier.wait()
            time.sleep(rng.random() * 0.004)
            try:
                results[k] = action(conn)
                conn.commit()
            except Exception as exc:  # reported to the test, which fails on it
                conn.rollback()
                results[k] = exc

    threads = [threading.Thread(target=run, args=(k, a)) for k, a in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(isinstance(r, Exception) for r in results), results
    return results


def event_counts(conn: psycopg.Connection, schema: str, ids: list[int]) -> dict[int, int]:
    rows = conn.execute(
        f"SELECT convert_from(key, 'UTF8')::int8, count(*) FROM \"{schema}\".outbox "
        "WHERE convert_from(key, 'UTF8')::int8 = ANY(%s) GROUP BY 1",
        [ids],
    ).fetchall()
    return {i: dict(rows).get(i, 0) for i in ids}


@pytest.fixture
def setup(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:

        def make(n: int = 0, *, parent: int | None = None, close: bool = True, **kw: object) -> int:
            b = tracker.open_batch(conn, parent=parent, schema=schema, **kw)  # type: ignore[arg-type]
            if n:
                tracker.add_items(conn, b, n, schema=schema)
            if close:
                tracker.close_batch(conn, b, schema=schema)
            conn.commit()
            return b.id

        yield conn, make


def _ack(schema: str, ids: list[str]) -> Action:
    return lambda c: tracker.ack(c, ids, claims=False, schema=schema)


def _claim(schema: str, ids: list[str]) -> Action:
    return lambda c: tracker.ack(c, ids, schema=schema)  # claims, settled at commit


def _fail(schema: str, ids: list[str]) -> Action:
    return lambda c: tracker.fail(c, ids, "gave up", schema=schema)


def _close(schema: str, batch_id: int) -> Action:
    return lambda c: tracker.close_batch(c, batch_id, schema=schema)


def check(conn: psycopg.Connection, schema: str, ids: list[int]) -> None:
    """Never two events; exactly one each once settled. A finishing child never locks its parent:
    the parent folds it in under its own row lock, at its close or acks if they come after, else at
    the first settle after (the reaper's settler loop, run here as the loop would)."""
    conn.rollback()
    assert all(n <= 1 for n in event_counts(conn, schema, ids).values())
    assert invariant_violations(conn, schema) == []
    tracker.settle(conn, schema=schema, registry=None)
    conn.commit()
    assert event_counts(conn, schema, ids) == dict.fromkeys(ids, 1)
    assert invariant_violations(conn, schema) == []


@pytest.mark.parametrize("how", ["masked", "claims", "fail"])
def test_childs_final_outcome_races_its_parents_close(pg_dsn, schema, setup, how):
    conn, make = setup
    rng = random.Random(f"child-vs-close-{how}")
    path = {"masked": _ack, "claims": _claim, "fail": _fail}[how]
    for _ in range(ROUNDS):
        p = make(1, close=False)
        tracker.ack(conn, f"{p}:0:0", claims=False, schema=schema)
        conn.commit()
        c = make(2, parent=p)
        tracker.ack(conn, f"{c}:0:0", claims=False, schema=schema)
        conn.commit()
        race(pg_dsn, path(schema, [f"{c}:0:1"]), _close(schema, p), rng)
        check(conn, schema, [p, c])
        outcome = tracker.status(conn, p, schema=schema).outcome
        assert outcome == ("failed" if how == "fail" else "succeeded")


def test_two_children_finish_at_once(pg_dsn, schema, setup):
    conn, make = setup
    rng = random.Random("two-children")
    for _ in range(ROUNDS):
        p = make(close=False)
        c1, c2 = make(1, parent=p), make(1, parent=p)
        tracker.close_batch(conn, p, schema=schema)
        conn.commit()
        race(pg_dsn, _ack(schema, [f"{c1}:0:0"]), _fail(schema, [f"{c2}:0:0"]), rng)
        check(conn, schema, [p, c1, c2])
        s = tracker.status(conn, p, schema=schema)
        assert (s.state, s.outcome, s.children_open) == ("complete", "failed", 0)


@pytest.mark.parametrize("same_item", [False, True])
def test_final_failure_races_final_ack(pg_dsn, schema, setup, same_item):
    conn, make = setup
    rng = random.Random(f"fail-vs-ack-{same_item}")
    for _ in range(ROUNDS):
        b = make(2)
        acked = f"{b}:0:0" if same_item else f"{b}:0:1"
        if same_item:
            tracker.ack(conn, f"{b}:0:1", claims=False, schema=schema)
            conn.commit()
        got = race(pg_dsn, _fail(schema, [f"{b}:0:0"]), _ack(schema, [acked]), rng)
        check(conn, schema, [b])
        s = tracker.status(conn, b, schema=schema)
        assert s.pending == 0 and s.succeeded + s.failed == 2
        if same_item:  # exactly one of them recorded the item; the other saw a duplicate
            assert got[0].failed + got[1].acked == 1  # type: ignore[union-attr]
            assert s.outcome == ("failed" if got[0].failed else "succeeded")  # type: ignore[union-attr]
        else:
            assert s.outcome == "failed"


def test_threshold_crossing_races_close(pg_dsn, schema, setup):
    conn, make = setup
    rng = random.Random("threshold-vs-close")
    for k in range(ROUNDS):
        kw = {"tolerated_failures": 0} if k % 2 else {"tolerated_failure_ratio": 0.4}
        b = make(2, close=False, **kw)
        race(pg_dsn, _fail(schema, [f"{b}:0:0"]), _close(schema, b), rng)
        check(conn, schema, [b])
        s = tracker.status(conn, b, schema=schema)
        assert (s.state, s.outcome, s.pending, s.failed) == ("complete", "failed", 1, 1)


def test_child_expiry_races_parents_close(pg_dsn, schema, setup):
    conn, make = setup
    rng = random.Random("expiry-vs-close")

    def expire(child: int) -> Action:
        return lambda c: expire_batch(c, child, schema=schema, registry=None)

    for _ in range(ROUNDS):
        p = make(close=False)
        c = make(3, parent=p, close=False)
        race(pg_dsn, expire(c), _close(schema, p), rng)
        check(conn, schema, [p, c])
        s = tracker.status(conn, p, schema=schema)
        assert (s.state, s.outcome) == ("complete", "failed")
