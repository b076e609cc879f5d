"""Outcomes through the Python API: failed items and their reasons, thresholds, nested batches,
expiry of children, and the typed errors of bad input (naming the value as written)."""

from __future__ import annotations

import asyncio
import json

import psycopg
import pytest
from test_tracker_support import invariant_violations, snapshot

import tracker
from tracker import aio
from tracker.expiry import expire_batch, sweep


def events(conn: psycopg.Connection, schema: str) -> dict[int, list[dict]]:
    """Every event in the outbox by batch id (completion and expiry), in insertion order."""
    got: dict[int, list[dict]] = {}
    for key, value in conn.execute(f'SELECT key, value FROM "{schema}".outbox ORDER BY id').fetchall():
        got.setdefault(int(bytes(key)), []).append(json.loads(bytes(value)))
    return got


def batch_row(conn: psycopg.Connection, schema: str, batch_id: int) -> dict:
    cur = conn.execute(f'SELECT * FROM "{schema}".batch WHERE id = %s', [batch_id])
    names = [d.name for d in cur.description]
    return dict(zip(names, cur.fetchone()))


def test_failed_items_finish_the_batch_as_failed_with_counts_and_reasons(conn, schema):
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, 5, schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    r = tracker.fail(conn, [f"{b.id}:0:1", f"{b.id}:0:3"], "timeout", schema=schema)
    assert (r.failed, r.duplicates, r.completed) == (2, 0, [])
    # the first outcome recorded wins: acking a failed item, failing an acked one are duplicates
    tracker.ack(conn, [f"{b.id}:0:0"], schema=schema, claims=False)
    assert tracker.fail(conn, [f"{b.id}:0:0", f"{b.id}:0:1"], "other", schema=schema).duplicates == 2
    assert tracker.ack(conn, [f"{b.id}:0:3"], schema=schema, claims=False).duplicates == 1
    s = tracker.status(conn, b, schema=schema)
    assert (s.state, s.pending, s.succeeded, s.failed, s.outcome) == ("closed", 2, 1, 2, None)
    r = tracker.fail(conn, f"{b.id}:0:2", "bad input", schema=schema)
    assert r.completed == []
    assert tracker.ack(conn, [f"{b.id}:0:4"], schema=schema, claims=False).completed == [b.id]
    s = tracker.status(conn, b, schema=schema)
    assert (s.state, s.pending, s.succeeded, s.failed, s.late, s.outcome) == ("complete", 0, 2, 3, 0, "failed")
    [event] = events(conn, schema)[b.id]
    assert (event["event"], event["schema_version"], event["outcome"]) == ("batch.completed", 2, "failed")
    assert (event["succeeded"], event["failed"], event["pending"]) == (2, 3, 0)
    assert event["rollup"] == {"total": 5, "succeeded": 2, "failed": 3}
    page = tracker.failures(conn, b, schema=schema)
    assert page.items == [(f"{b.id}:0:1", "timeout"), (f"{b.id}:0:2", "bad input"), (f"{b.id}:0:3", "timeout")]
    assert page.next is None
    # one reason shared by many failures is stored once
    assert conn.execute(f'SELECT count(*) FROM "{schema}".failure_reason').fetchone() == (2,)
    assert invariant_violations(conn, schema) == []


def test_failures_are_paged_in_item_order_across_groups(conn, schema):
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, 8192 + 20, schema=schema)
    failed = [f"{b.id}:0:{i}" for i in range(0, 8192, 700)] + [f"{b.id}:1:{i}" for i in (0, 5, 19)]
    tracker.fail(conn, failed[::2], "a", schema=schema)
    tracker.fail(conn, failed[1::2], "b", schema=schema)
    seen, after, pages = [], None, 0
    while True:
        page = tracker.failures(conn, b, after=after, limit=4, schema=schema)
        assert len(page.items) <= 4
        seen.extend(page.items)
        pages += 1
        if page.next is None:
            break
        after = page.next
    assert [i for i, _ in seen] == failed
    assert [r for _, r in seen] == ["a" if k % 2 == 0 else "b" for k in range(len(failed))]
    assert pages == len(failed) // 4 + 1


def test_count_threshold_finishes_early_once_and_later_outcomes_are_late(conn, schema):
    b = tracker.open_batch(conn, tolerated_failures=1, schema=schema)
    tracker.add_items(conn, b, 10, schema=schema)
    assert tracker.fail(conn, f"{b.id}:0:0", "x", schema=schema).completed == []
    assert tracker.fail(conn, f"{b.id}:0:1", "x", schema=schema).completed == [b.id]  # 2 > 1, still open
    s = tracker.status(conn, b, schema=schema)
    assert (s.state, s.outcome, s.pending, s.failed) == ("complete", "failed", 8, 2)
    r = tracker.ack(conn, [f"{b.id}:0:2-4"], schema=schema, claims=False)
    assert (r.acked, r.completed) == (3, [])
    tracker.fail(conn, f"{b.id}:0:5", "x", schema=schema)
    s = tracker.status(conn, b, schema=schema)
    assert (s.pending, s.succeeded, s.failed, s.late, s.outcome) == (4, 3, 3, 4, "failed")
    assert tracker.close_batch(conn, b, schema=schema) is True
    [event] = events(conn, schema)[b.id]
    assert (event["outcome"], event["pending"], event["failed"]) == ("failed", 8, 2)
    assert event["rollup"] == {"total": 10, "succeeded": 0, "failed": 10}  # pending at an early finish: failed
    with pytest.raises(tracker.BatchNotOpen):
        tracker.add_items(conn, b, 1, schema=schema)
    assert invariant_violations(conn, schema) == []


def test_ratio_threshold_applies_once_closed(conn, schema):
    b = tracker.open_batch(conn, tolerated_failure_ratio=0.25, schema=schema)
    tracker.add_items(conn, b, 4, schema=schema)
    tracker.fail(conn, [f"{b.id}:0:0", f"{b.id}:0:1"], "x", schema=schema)  # 2 > 1, but not closed
    assert tracker.status(conn, b, schema=schema).state == "open"
    assert tracker.close_batch(conn, b, schema=schema) is True
    assert tracker.status(conn, b, schema=schema).outcome == "failed"
    ok = tracker.open_batch(conn, tolerated_failure_ratio=0.5, schema=schema)
    tracker.add_items(conn, ok, 4, schema=schema)
    tracker.close_batch(conn, ok, schema=schema)
    tracker.fail(conn, [f"{ok.id}:0:0", f"{ok.id}:0:1"], "x", schema=schema)  # 2 = 0.5 * 4: tolerated
    assert tracker.status(conn, ok, schema=schema).state == "closed"
    assert tracker.ack(conn, [f"{ok.id}:0:2-3"], schema=schema, claims=False).completed == [ok.id]
    assert tracker.status(conn, ok, schema=schema).outcome == "failed"  # an item failed


def test_parent_finishes_after_its_children_with_their_rollup(conn, schema):
    p = tracker.open_batch(conn, user_key="parent", schema=schema)
    tracker.add_items(conn, p, 2, schema=schema)
    c1 = tracker.open_batch(conn, parent=p, schema=schema)
    c2 = tracker.open_batch(conn, parent=p.id, schema=schema)
    g = tracker.open_batch(conn, parent=c2, schema=schema)
    for b, n in ((c1, 3), (c2, 1), (g, 2)):
        tracker.add_items(conn, b, n, schema=schema)
        tracker.close_batch(conn, b, schema=schema)
    tracker.close_batch(conn, p, schema=schema)
    tracker.ack(conn, [f"{p.id}:0:0-1", f"{c1.id}:0:0-2", f"{c2.id}:0:0"], schema=schema, claims=False)
    s = tracker.status(conn, p, schema=schema)
    assert (s.state, s.children_open, s.pending) == ("closed", 1, 0)  # c2 waits for g, p for c2
    assert tracker.status(conn, c2, schema=schema).children_open == 1
    r = tracker.fail(conn, f"{g.id}:0:1", "lost", schema=schema)
    assert r.completed == []
    r = tracker.ack(conn, f"{g.id}:0:0", schema=schema, claims=False)
    assert r.completed == [g.id]  # g never locks c2: c2 and p finish at the next settle
    assert tracker.status(conn, c2, schema=schema).state == "closed"
    assert tracker.settle(conn, schema=schema).completed == [c2.id, p.id]  # one level per pass
    ev = events(conn, schema)
    assert all(len(ev[b.id]) == 1 for b in (p, c1, c2, g))
    assert ev[g.id][0]["parent_id"] == c2.id and ev[g.id][0]["outcome"] == "failed"
    assert ev[c2.id][0]["rollup"] == {"total": 3, "succeeded": 2, "failed": 1}
    assert ev[c2.id][0]["children"] == {"total": 1, "failed": 1}
    assert ev[p.id][0]["rollup"] == {"total": 8, "succeeded": 7, "failed": 1}
    assert ev[p.id][0]["children"] == {"total": 2, "failed": 1}
    assert (ev[p.id][0]["outcome"], ev[p.id][0]["succeeded"], ev[p.id][0]["failed"]) == ("failed", 2, 0)
    s = tracker.status(conn, p, schema=schema)
    assert (s.outcome, s.children_open, s.parent_id) == ("failed", 0, None)
    assert (s.children, s.children_failed) == (2, 1)  # c2 finished failed (its child g did)
    assert tracker.status(conn, g, schema=schema).parent_id == c2.id
    assert invariant_violations(conn, schema) == []


def test_parent_threshold_applies_to_the_rollup(conn, schema):
    p = tracker.open_batch(conn, tolerated_failures=1, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    tracker.add_items(conn, c, 3, schema=schema)
    tracker.close_batch(conn, c, schema=schema)
    tracker.fail(conn, [f"{c.id}:0:0-1"], "x", schema=schema)
    assert tracker.status(conn, p, schema=schema).state == "open"  # c not finished yet
    tracker.ack(conn, f"{c.id}:0:2", schema=schema, claims=False)
    assert tracker.status(conn, p, schema=schema).state == "open"  # c finished: p folds it in at its next settle
    assert tracker.settle(conn, schema=schema).completed == [p.id]
    s = tracker.status(conn, p, schema=schema)
    assert (s.state, s.outcome) == ("complete", "failed")  # 2 rolled-up failures > 1, never closed


def test_child_refused_under_a_parent_not_open_and_too_deep(conn, schema):
    p = tracker.open_batch(conn, schema=schema)
    tracker.close_batch(conn, p, schema=schema)  # empty: complete
    with pytest.raises(tracker.ParentNotOpen, match=f"parent batch {p.id} is complete"):
        tracker.open_batch(conn, parent=p, schema=schema)
    with pytest.raises(tracker.UnknownBatch, match=r"unknown batch 999999999 \(parent\)"):
        tracker.open_batch(conn, parent=999999999, schema=schema)
    top = b = tracker.open_batch(conn, schema=schema)
    for _ in range(7):
        b = tracker.open_batch(conn, parent=b, schema=schema)
    before = snapshot(conn, schema)
    with pytest.raises(tracker.DepthExceeded, match=f"parent batch {b.id} is at depth 7: batches nest at most 8"):
        tracker.open_batch(conn, parent=b, schema=schema)
    assert snapshot(conn, schema) == before
    assert tracker.status(conn, top, schema=schema).children_open == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "shown"),
    [
        ({"tolerated_failures": -1}, tracker.InvalidValue, "tolerated_failures -1"),
        ({"tolerated_failures": 1.5}, tracker.InvalidArgument, "float 1.5"),
        ({"tolerated_failures": True}, tracker.InvalidArgument, "bool True"),
        ({"tolerated_failure_ratio": 1.01}, tracker.InvalidValue, "tolerated_failure_ratio 1.01"),
        ({"tolerated_failure_ratio": float("nan")}, tracker.InvalidValue, "tolerated_failure_ratio nan"),
        ({"tolerated_failure_ratio": "0.1"}, tracker.InvalidArgument, "str '0.1'"),
        ({"parent": "7"}, tracker.InvalidArgument, "parent must be"),
    ],
)
def test_bad_open_arguments_are_typed_and_named(conn, schema, kwargs, error, shown):
    with pytest.raises(error, match=shown.replace("(", r"\(").replace(".", r"\.")):
        tracker.open_batch(conn, schema=schema, **kwargs)


def test_bad_fail_and_failures_arguments_are_typed_and_named(conn, schema):
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, 3, schema=schema)
    conn.commit()
    before = snapshot(conn, schema)
    with pytest.raises(tracker.InvalidValue, match="is longer than 500 characters \\(501\\)"):
        tracker.fail(conn, f"{b.id}:0:0", "r" * 501, schema=schema)
    with pytest.raises(tracker.InvalidValue, match="reason '': must be a non-empty string"):
        tracker.fail(conn, f"{b.id}:0:0", "", schema=schema)
    with pytest.raises(tracker.InvalidArgument, match="reason must be"):
        tracker.fail(conn, f"{b.id}:0:0", None, schema=schema)  # type: ignore[arg-type]
    with pytest.raises(tracker.IndexOutOfRange, match=f"'{b.id}:0:1-9'"):
        tracker.fail(conn, [f"{b.id}:0:0", f"{b.id}:0:1-9"], "x", schema=schema)
    with pytest.raises(tracker.UnknownGroup, match=f"{b.id}:4:0"):
        tracker.fail(conn, f"{b.id}:4:0", "x", schema=schema)
    with pytest.raises(tracker.MalformedItemId, match="'nope'"):
        tracker.fail(conn, "nope", "x", schema=schema)
    for limit, error in ((0, tracker.InvalidValue), (1001, tracker.InvalidValue), ("5", tracker.InvalidArgument)):
        with pytest.raises(error, match=f"limit {limit!r}" if error is tracker.InvalidValue else "limit must be"):
            tracker.failures(conn, b, limit=limit, schema=schema)  # type: ignore[arg-type]
    other = f"{b.id + 1}:0:0"
    with pytest.raises(tracker.InvalidValue, match=f"after '{other}': is not an item id of batch {b.id}"):
        tracker.failures(conn, b, after=other, schema=schema)
    with pytest.raises(tracker.UnknownBatch, match="unknown batch 123456789"):
        tracker.failures(conn, 123456789, schema=schema)
    assert snapshot(conn, schema) == before
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # usable, unchanged
    conn.execute("SELECT 1")


def test_an_expired_child_reaches_its_parent_at_the_next_settle(conn, schema):
    p = tracker.open_batch(conn, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    tracker.add_items(conn, c, 4, schema=schema)
    tracker.ack(conn, f"{c.id}:0:0", schema=schema, claims=False)
    tracker.close_batch(conn, p, schema=schema)
    conn.commit()
    # the sweep never expires a parent with open children; the idle child goes first
    assert sweep(conn, schema=schema, idle_expiry=0, retention=3600, max_chunks=1).expired == 1
    ev = events(conn, schema)
    assert ev[c.id][0]["outcome"] == "expired"
    assert ev[c.id][0]["rollup"] == {"total": 4, "succeeded": 1, "failed": 3}
    assert p.id not in ev  # the expiry never locks the parent: it folds the child in when settled
    assert tracker.settle(conn, schema=schema).completed == [p.id]
    ev = events(conn, schema)
    # the parent counted exactly what the child's event reports, and finished (failed) with it
    [done] = ev[p.id]
    assert (done["event"], done["outcome"]) == ("batch.completed", "failed")
    assert done["rollup"] == {"total": 4, "succeeded": 1, "failed": 3}
    assert done["children"] == {"total": 1, "failed": 1}
    assert invariant_violations(conn, schema) == []


def test_operator_expiry_of_a_child_reaches_the_parent(conn, schema):
    p = tracker.open_batch(conn, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    tracker.close_batch(conn, p, schema=schema)
    assert expire_batch(conn, c.id, schema=schema) is not None
    assert tracker.status(conn, p, schema=schema).children_open == 1  # until p is settled
    assert tracker.settle(conn, schema=schema).completed == [p.id]
    assert tracker.status(conn, p, schema=schema).outcome == "failed"
    assert len(events(conn, schema)[p.id]) == 1


def test_sweep_leaves_parents_with_open_children(conn, schema):
    p = tracker.open_batch(conn, schema=schema)
    c = tracker.open_batch(conn, parent=p, schema=schema)
    conn.commit()
    conn.execute(f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '1 hour'")
    conn.execute(f'UPDATE "{schema}".batch SET last_activity_at = now() WHERE id = %s', [c.id])
    conn.commit()
    assert sweep(conn, schema=schema, idle_expiry=60, retention=3600).expired == 0
    assert tracker.status(conn, p, schema=schema).state == "open"


def test_async_face_fail_failures_and_children(pg_dsn, schema):
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as c:
            p = await aio.open_batch(c, schema=schema, tolerated_failure_ratio=0.0)
            ch = await aio.open_batch(c, parent=p, schema=schema)
            await aio.add_items(c, ch, 2, schema=schema)
            await aio.close_batch(c, ch, schema=schema)
            r = await aio.fail(c, [f"{ch.id}:0:0-1"], "nope", schema=schema)
            assert (r.failed, r.completed) == (2, [ch.id])
            page = await aio.failures(c, ch, limit=1, schema=schema)
            assert page.items == [(f"{ch.id}:0:0", "nope")] and page.next == f"{ch.id}:0:0"
            page = await aio.failures(c, ch, after=page.next, limit=1, schema=schema)
            assert page.items == [(f"{ch.id}:0:1", "nope")]
            s = await aio.status(c, p, schema=schema)
            assert (s.state, s.children_open) == ("open", 1)  # ch finished: p's close folds it in
            assert await aio.close_batch(c, p, schema=schema) is True
            assert (await aio.status(c, p, schema=schema)).outcome == "failed"

    asyncio.run(main())
