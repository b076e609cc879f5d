"""Every parent finishes (or expires) once, whatever finished its children and whoever runs.

A finishing child leaves a child_finished row that its parent folds in under its own row lock
(sql/R__outcomes.sql, batch_finish). These tests look for the parents nobody folds and for the
locks that row's insertion can wait on:

  * the sweeper alone (no settler running, `settler.enabled: false`) still finishes or expires a
    parent whose children finished or expired;
  * a child completed or expired by a writer of the previous release (not yet redeployed when
    `reaper migrate` ran) still reaches its parent;
  * retention deleting a parent (finished early, a child still open) never deadlocks with the
    child's final ack.
"""

from __future__ import annotations

import random
import threading
import time

import psycopg
from test_outcomes_api import events
from test_outcomes_race import _claim, _close, _fail, check, event_counts, race, setup  # noqa: F401 (fixture)
from test_tracker_support import invariant_violations

import tracker
from tracker.expiry import sweep


def _parent_with_a_closed_child(conn: psycopg.Connection, schema: str, items: int = 1) -> tuple[int, int, list[str]]:
    p = tracker.open_batch(conn, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    groups = tracker.add_items(conn, c, items, schema=schema)
    tracker.close_batch(conn, c, schema=schema)
    tracker.close_batch(conn, p, schema=schema)
    conn.commit()
    return p.id, c.id, [f"{c.id}:{g.group_id}:{i}" for g in groups for i in range(g.start, g.upto)]


def test_without_the_settler_the_sweeper_finishes_a_parent_whose_last_child_expired(conn, schema):
    """docs/howto/outcomes.md: "The sweeper never expires a batch that has open children: the
    children expire first, when idle." With no settler running nobody else folds the expired child in."""
    p, c, _ = _parent_with_a_closed_child(conn, schema)
    for _ in range(4):  # the reaper's sweeper, every sweeper.interval; no settler
        sweep(conn, schema=schema, idle_expiry=0, retention=3600)
    s = tracker.status(conn, p, schema=schema)
    assert tracker.status(conn, c, schema=schema).state == "expired"
    assert (s.state, s.outcome, s.children_open) == ("complete", "failed", 0), s
    assert [e["event"] for e in events(conn, schema)[p]] == ["batch.completed"]
    assert invariant_violations(conn, schema) == []


def test_without_the_settler_the_sweeper_finishes_a_parent_whose_last_child_completed(conn, schema):
    """A child's final ack commits after the parent's close: the close could not fold it in."""
    p, c, items = _parent_with_a_closed_child(conn, schema)
    tracker.ack(conn, items, schema=schema)  # claims, settled at commit: the child completes
    conn.commit()
    assert tracker.status(conn, c, schema=schema).state == "complete"
    sweep(conn, schema=schema, idle_expiry=3600, retention=3600)
    s = tracker.status(conn, p, schema=schema)
    assert (s.state, s.outcome, s.children_open) == ("complete", "succeeded", 0), s
    [done] = events(conn, schema)[p]
    assert done["rollup"] == {"total": 1, "succeeded": 1, "failed": 0}


def test_a_child_completed_by_a_writer_of_the_previous_release_reaches_its_parent(conn, schema):
    p, c, _ = _parent_with_a_closed_child(conn, schema, items=2)
    # The previous release's masked ack completing the child (see test_outcomes_upgrade.py).
    conn.execute(
        "WITH g AS (UPDATE batch_group SET bits = bits & ~bits, pending = 0 WHERE batch_id = %(c)s RETURNING 1) "
        "UPDATE batch b SET pending = 0, last_activity_at = clock_timestamp(), "
        "state = CASE WHEN b.state = 'closed' THEN 'complete' ELSE b.state END, "
        "completed_at = CASE WHEN b.state = 'closed' THEN clock_timestamp() ELSE b.completed_at END "
        "WHERE b.id = %(c)s",
        {"c": c},
    )
    conn.commit()
    assert tracker.status(conn, c, schema=schema).outcome == "succeeded"
    assert invariant_violations(conn, schema) == []
    assert tracker.settle(conn, schema=schema).completed == [p]
    s = tracker.status(conn, p, schema=schema)
    assert (s.state, s.outcome, s.children_open) == ("complete", "succeeded", 0), s


def test_a_child_expired_by_a_sweeper_of_the_previous_release_reaches_its_parent(conn, schema):
    p, c, _ = _parent_with_a_closed_child(conn, schema, items=2)
    # The previous release's sweeper: it expires the child and knows nothing of parents.
    conn.execute(
        "UPDATE batch SET state = 'expired', expired_at = clock_timestamp() WHERE id = %s AND state IN ('open', 'closed')",
        [c],
    )
    conn.commit()
    assert invariant_violations(conn, schema) == []
    assert tracker.settle(conn, schema=schema).completed == [p]
    s = tracker.status(conn, p, schema=schema)
    assert (s.state, s.outcome, s.children_open) == ("complete", "failed", 0), s
    [done] = events(conn, schema)[p]
    assert done["rollup"] == {"total": 2, "succeeded": 0, "failed": 2}


def _wait_until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_retention_deleting_a_parent_never_deadlocks_with_its_childs_final_ack(pg_dsn, conn, schema):
    """A parent finished early (a threshold) while a child is still open; retention comes for the
    parent while a consumer holds the child (an ack of its own, uncommitted); the consumer's final
    ack of the child then leaves the row for the parent. Neither may fail."""
    p = tracker.open_batch(conn, tolerated_failures=0, schema=schema)
    [pg] = tracker.add_items(conn, p, 1, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    [cg] = tracker.add_items(conn, c, 2, schema=schema)
    tracker.close_batch(conn, c, schema=schema)
    conn.commit()
    assert tracker.fail(conn, f"{p.id}:{pg.group_id}:0", "bad", schema=schema).completed == [p.id]
    conn.commit()
    result: list[object] = []
    with psycopg.connect(pg_dsn) as consumer, psycopg.connect(pg_dsn) as sweeper:
        consumer.execute(f'SET search_path TO "{schema}"')
        tracker.ack(consumer, f"{c.id}:{cg.group_id}:0", schema=schema, claims=False)  # holds the child
        pid = sweeper.info.backend_pid

        def retention() -> None:
            try:
                result.append(sweep(sweeper, schema=schema, idle_expiry=3600, retention=0))
            except psycopg.Error as exc:
                result.append(exc)

        t = threading.Thread(target=retention)
        t.start()
        # the retention either waits (for the child's row) or is done
        _wait_until(
            lambda: (
                bool(result)
                or conn.execute(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", [pid]
                ).fetchone()[0]
            ),
            5,
        )
        conn.rollback()
        try:
            tracker.ack(consumer, f"{c.id}:{cg.group_id}:1", schema=schema, claims=False)
            consumer.commit()
            ack_error = None
        except psycopg.Error as exc:
            consumer.rollback()
            ack_error = exc
        t.join(20)
    assert ack_error is None, f"the child's final ack failed: {ack_error!r}"
    assert not any(isinstance(r, Exception) for r in result), result
    assert tracker.status(conn, c, schema=schema).state == "complete"
    assert invariant_violations(conn, schema) == []


def test_operator_expiry_of_a_parent_counts_the_children_that_finished_before_it(conn, schema):
    """A child finished (its row not folded in yet), then an operator expires the parent: the
    parent's expiry event reports the child's roll-up, as its row does once folded."""
    from tracker.expiry import expire_batch

    p = tracker.open_batch(conn, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    [g] = tracker.add_items(conn, c, 2, schema=schema)
    tracker.close_batch(conn, c, schema=schema)
    conn.commit()
    tracker.ack(conn, [f"{c.id}:{g.group_id}:0", f"{c.id}:{g.group_id}:1"], schema=schema)
    conn.commit()
    assert tracker.status(conn, c, schema=schema).state == "complete"
    assert expire_batch(conn, p.id, schema=schema) is not None
    conn.commit()
    tracker.settle(conn, schema=schema)
    conn.commit()
    [expired] = events(conn, schema)[p.id]
    row = conn.execute(
        "SELECT total + rollup_total, pending + failed + rollup_failed, children_failed FROM batch WHERE id = %s",
        [p.id],
    ).fetchone()
    assert (expired["rollup"]["total"], expired["rollup"]["failed"], expired["children"]["failed"]) == row
    assert expired["rollup"] == {"total": 2, "succeeded": 2, "failed": 0}


ROUNDS = 15


def test_sweeper_fold_races_settler_and_a_childs_final_ack(pg_dsn, schema, setup):  # noqa: F811
    """The sweep's fold and a settle (or the parent's close) fold the same parent at once: each row
    once, one event per batch, no error, no deadlock."""
    conn, make = setup
    rng = random.Random("sweep-fold-vs-settle")
    for k in range(ROUNDS):
        p = make(close=False)
        c = make(1, parent=p)
        if k % 2 == 0:
            tracker.close_batch(conn, p, schema=schema)
            conn.commit()
        tracker.ack(conn, f"{c}:0:0", schema=schema, claims=False)  # the child completes: a row for p
        conn.commit()
        other = (lambda cn: tracker.settle(cn, schema=schema, registry=None)) if k % 2 == 0 else _close(schema, p)
        race(pg_dsn, lambda cn: sweep(cn, schema=schema, idle_expiry=3600, retention=3600, registry=None), other, rng)
        check(conn, schema, [p, c])
        assert tracker.status(conn, p, schema=schema).outcome == "succeeded"


def test_retention_races_a_childs_final_ack_under_an_early_finished_parent(pg_dsn, schema, setup):  # noqa: F811
    conn, make = setup
    rng = random.Random("retention-vs-child")
    for k in range(ROUNDS):
        p = make(1, close=False, tolerated_failures=0)
        c = make(2, parent=p)
        tracker.fail(conn, f"{p}:0:0", "bad", schema=schema)
        conn.commit()
        conn.execute(
            f"UPDATE \"{schema}\".batch SET completed_at = completed_at - interval '1 hour' WHERE id = %s", [p]
        )
        conn.commit()
        ids = [f"{c}:0:0", f"{c}:0:1"]
        final = _claim(schema, ids) if k % 2 else (lambda cn: tracker.ack(cn, ids, schema=schema, claims=False))
        race(pg_dsn, final, lambda cn: sweep(cn, schema=schema, idle_expiry=3600, retention=60, registry=None), rng)
        conn.rollback()
        tracker.settle(conn, schema=schema, registry=None)
        conn.commit()
        assert tracker.status(conn, c, schema=schema).state == "complete"
        assert invariant_violations(conn, schema) == []
        # the parent goes once its child finished and was folded in
        sweep(conn, schema=schema, idle_expiry=3600, retention=60, registry=None)
        assert conn.execute(f'SELECT count(*) FROM "{schema}".batch WHERE id = %s', [p]).fetchone()[0] == 0


def test_operator_expiry_of_a_parent_races_its_childs_final_ack(pg_dsn, schema, setup):  # noqa: F811
    from tracker.expiry import expire_batch

    conn, make = setup
    rng = random.Random("expire-parent-vs-child")
    for k in range(ROUNDS):
        p = make(close=False)
        c = make(1, parent=p)
        if k % 2 == 0:
            tracker.close_batch(conn, p, schema=schema)
            conn.commit()
        race(
            pg_dsn,
            _claim(schema, [f"{c}:0:0"]) if k % 2 else _fail(schema, [f"{c}:0:0"]),
            lambda cn: expire_batch(cn, p, schema=schema, registry=None),
            rng,
        )
        check(conn, schema, [c])
        assert event_counts(conn, schema, [p]) == {p: 1}
        conn.rollback()
        [ev] = events(conn, schema)[p]
        row = conn.execute(
            f'SELECT total + rollup_total, children_open FROM "{schema}".batch WHERE id = %s', [p]
        ).fetchone()
        # the event counted the child exactly when it had finished before the expiry
        assert ev["rollup"]["total"] in (0, 1) and row == (1, 0)
