"""Finishing children in two trees at once: the walk up to a parent must not deadlock.

A path that finished a child and then took its parent's row lock after the locks it already held
would deadlock here: two calls that each finish a child of one tree while holding a batch of the
other tree (an item of the other tree's parent, named in the same call) would wait on each
other's parent, though each call, alone, locks in the documented order (descending ids). A
finishing child therefore never locks its parent (it leaves a child_finished row, folded in by the
parent under its own lock: sql/R__outcomes.sql), on the masked path (tracker.fail,
tracker.ack(claims=False), apply_masks, SQL fail/ack_masks) as on the claims path (tracker.ack,
settled at commit, where a deadlock would roll back the caller's whole transaction at COMMIT).
"""

from __future__ import annotations

import threading

import psycopg
import pytest

import tracker

ROUNDS = 4


def _two_trees(conn: psycopg.Connection, schema: str) -> tuple[list[str], list[str]]:
    def mk(n: int, parent: int | None = None, close: bool = True) -> tuple[int, list[str]]:
        b = tracker.open_batch(conn, parent=parent, schema=schema)  # type: ignore[arg-type]
        groups = tracker.add_items(conn, b, n, schema=schema)
        if close:
            tracker.close_batch(conn, b, schema=schema)
        conn.commit()
        return b.id, [f"{b.id}:{g.group_id}:{i}" for g in groups for i in range(g.start, g.upto)]

    p1, p1_items = mk(2, close=False)
    p2, p2_items = mk(2, close=False)
    _c1, c1_items = mk(1, parent=p1)
    _c2, c2_items = mk(1, parent=p2)
    # each call: the last item of one tree's child, and an item of the other tree's parent
    return [c1_items[0], p2_items[0]], [c2_items[0], p1_items[0]]


def _at_once(dsn: str, call, first: list[str], second: list[str]) -> list[str]:
    barrier = threading.Barrier(2)
    out = ["", ""]

    def run(k: int, ids: list[str]) -> None:
        with psycopg.connect(dsn) as c:
            barrier.wait()
            try:
                call(c, ids)
                c.commit()
                out[k] = "ok"
            except psycopg.Error as exc:
                out[k] = type(exc).__name__

    threads = [threading.Thread(target=run, args=(k, ids)) for k, ids in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(lambda s: lambda c, ids: tracker.fail(c, ids, "gave up", schema=s), id="fail"),
        pytest.param(lambda s: lambda c, ids: tracker.ack(c, ids, schema=s, claims=False), id="ack-masked"),
        pytest.param(lambda s: lambda c, ids: tracker.ack(c, ids, schema=s), id="ack-claims-at-commit"),
    ],
)
def test_finishing_children_of_two_trees_at_once_never_deadlocks(pg_dsn, schema, conn, path):
    call = path(schema)
    seen = []
    for _ in range(ROUNDS):
        first, second = _two_trees(conn, schema)
        seen.append(_at_once(pg_dsn, call, first, second))
    assert all(r == ["ok", "ok"] for r in seen), seen


@pytest.mark.parametrize("path", ["acker-skip-locked", "ack-claims-at-commit"])
def test_finishing_a_child_never_waits_for_a_transaction_holding_its_parent(pg_dsn, schema, conn, path):
    """The acker "never waits for an application transaction" (docs/howto/consumers.md), and a
    claims ack never waits at commit (it skips a held batch: the holder or a later settle folds
    it). A producer opening another child under the same parent holds the parent's row until it
    commits; the final ack of a closed child must not wait for that producer."""
    parent = tracker.open_batch(conn, schema=schema)
    conn.commit()
    child = tracker.open_batch(conn, parent=parent, schema=schema)
    [g] = tracker.add_items(conn, child, 1, schema=schema)
    tracker.close_batch(conn, child, schema=schema)
    conn.commit()
    tracker.open_batch(conn, parent=parent, schema=schema)  # a producer's open transaction: holds the parent
    try:
        with psycopg.connect(pg_dsn) as c:
            c.execute("SET lock_timeout = '2s'")
            item = f"{child.id}:{g.group_id}:0"
            try:
                if path == "acker-skip-locked":
                    tracker.apply_masks(c, tracker.fold([item]), skip_locked=True, schema=schema)
                else:
                    tracker.ack(c, [item], schema=schema)
                c.commit()
                waited = None
            except psycopg.errors.LockNotAvailable as exc:
                waited = exc
        assert waited is None, f"waited for the producer's transaction holding the parent: {waited}"
    finally:
        conn.rollback()


def test_the_reapers_settler_finishes_the_parents_of_a_finished_child(pg_dsn, schema, conn):
    """A finished child leaves its roll-up for its parent: the settler loop folds it in (the parent
    under its own row lock) and the parent, then the grandparent, finish, one event each, within
    a few settler intervals."""
    import time

    from harvester.services.claim_settler import ClaimSettler

    top = tracker.open_batch(conn, schema=schema)
    mid = tracker.open_batch(conn, parent=top, schema=schema)
    leaf = tracker.open_batch(conn, parent=mid, schema=schema)
    [g] = tracker.add_items(conn, leaf, 1, schema=schema)
    for b in (leaf, mid, top):
        tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    stop = threading.Event()
    settler = ClaimSettler(dsn=pg_dsn, schema=schema, interval=0.01)
    thread = threading.Thread(target=settler.run, args=(stop,), daemon=True)
    thread.start()
    try:
        with psycopg.connect(pg_dsn) as c:
            tracker.ack(c, [f"{leaf.id}:{g.group_id}:0"], schema=schema)
        deadline = time.monotonic() + 5
        while tracker.status(conn, top, schema=schema).state != "complete" and time.monotonic() < deadline:
            conn.rollback()
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    conn.rollback()
    rows = conn.execute(
        f"SELECT convert_from(key, 'UTF8')::int8, count(*) FROM \"{schema}\".outbox GROUP BY 1 ORDER BY 1"
    ).fetchall()
    assert rows == [(top.id, 1), (mid.id, 1), (leaf.id, 1)]
    s = tracker.status(conn, top, schema=schema)
    assert (s.state, s.outcome, s.children_open) == ("complete", "succeeded", 0)
