"""Storage of failures stays bounded over time: a reason is kept only while a retained batch has an
item that failed under it. Retention (tracker.expiry.sweep) deletes finished batches, and with
them their failed items (group_failure cascades); the reason texts must go too, else a reason
that carries anything item-specific (an upstream error message, an id, a time) grows
failure_reason by one row per failure, forever."""

from __future__ import annotations

import random

import psycopg

import tracker
from tracker.expiry import sweep


def test_retention_leaves_no_reason_that_no_retained_item_failed_under(pg_dsn, schema, conn):
    b = tracker.open_batch(conn, schema=schema)
    [g] = tracker.add_items(conn, b, 50, schema=schema)
    for i in range(50):  # item-specific reasons, as real error messages are
        tracker.fail(conn, [f"{b.id}:{g.group_id}:{i}"], f"HTTP 503 from upstream, request {i}", schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    conn.commit()
    assert tracker.status(conn, b, schema=schema).state == "complete"
    conn.commit()
    with psycopg.connect(pg_dsn) as c:
        got = sweep(c, schema=schema, idle_expiry=3600, retention=0, registry=None)
        c.commit()
    assert got.deleted == 1
    (failed_items,) = conn.execute("SELECT count(*) FROM group_failure").fetchone()
    (reasons,) = conn.execute("SELECT count(*) FROM failure_reason").fetchone()
    assert (failed_items, reasons) == (0, 0)


def test_a_reason_row_takes_the_smaller_form_of_its_items(conn, schema):
    b = tracker.open_batch(conn, schema=schema)
    [g] = tracker.add_items(conn, b, 8192, schema=schema)
    for i in range(0, 1200, 3):  # 400 items, each with a reason of its own
        tracker.fail(conn, [f"{b.id}:0:{i}"], f"timeout at {i}", schema=schema)
    tracker.fail(conn, [f"{b.id}:0:3001-4000"], "shared", schema=schema)  # 1,000 items, one reason
    tracker.fail(conn, [f"{b.id}:0:5000", f"{b.id}:0:6000", f"{b.id}:0:7000"], "few", schema=schema)
    conn.commit()
    rows = conn.execute(
        "SELECT r.text, f.lo, f.hi, cardinality(f.items), bit_count(f.bits), pg_column_size(f.items),"
        " pg_column_size(f.bits) FROM group_failure f JOIN failure_reason r ON r.id = f.reason_id ORDER BY f.lo"
    ).fetchall()
    assert len(rows) == 402
    singles = [r for r in rows if r[0].startswith("timeout")]
    # One item: its index in a one-element array (no group-size bitmap), a few bytes.
    assert all(r[3] == 1 and r[4] is None and r[1] == r[2] and r[5] <= 32 for r in singles)
    [shared] = [r for r in rows if r[0] == "shared"]
    assert (shared[1], shared[2], shared[3], shared[4]) == (3001, 4000, None, 1000)  # a bitmap: 1 KiB, not 2
    assert shared[6] <= 8192 // 8 + 16
    [few] = [r for r in rows if r[0] == "few"]
    assert (few[1], few[2], few[3], few[4]) == (5000, 7000, 3, None)
    (stored,) = conn.execute("SELECT sum(pg_column_size(f.*)) FROM group_failure f").fetchone()
    assert stored < 402 * 100 + 8192 // 8  # ~80 bytes a row, not 1 KiB: proportional to what failed


def _model_pages(conn, schema, batch, limit):
    got, after = [], None
    while True:
        page = tracker.failures(conn, batch, after=after, limit=limit, schema=schema)
        got += page.items
        if page.next is None:
            return got
        assert len(page.items) == limit and page.next == page.items[-1][0]
        after = page.next


def test_pages_walk_every_form_in_item_order_against_a_model(conn, schema):
    """Random failures (shared, item-specific and growing reasons, across groups of different
    sizes, a group grown after its failures): every paging gives exactly the model's list."""
    rng = random.Random(20261124)
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, 8192 * 2 + 700, schema=schema)
    model: dict[tuple[int, int], str] = {}
    sizes = {0: 8192, 1: 8192, 2: 700}
    for step in range(200):
        reason = rng.choice(["shared A", "shared B", f"own {step}", f"mid {step % 7}"])
        n = rng.choice([1, 1, 2, 5, 40, 700])
        ids = []
        for _ in range(n):
            gid = rng.choice(list(sizes))
            i = rng.randrange(sizes[gid])
            ids.append(f"{b.id}:{gid}:{i}")
            model.setdefault((gid, i), reason)  # the first outcome wins
        if step == 100:
            tracker.add_items(conn, b, 4000, schema=schema)  # group 2 grows to 4,700
            sizes[2] = 4700
        tracker.fail(conn, ids, reason, schema=schema)
    conn.commit()
    bitmaps, arrays_of_several = conn.execute(
        "SELECT count(*) FILTER (WHERE bits IS NOT NULL), count(*) FILTER (WHERE items IS NOT NULL AND hi > lo)"
        " FROM group_failure"
    ).fetchone()
    assert bitmaps > 0 and arrays_of_several > 0  # both forms, and rows a cursor can fall inside of
    want = [(f"{b.id}:{g}:{i}", model[(g, i)]) for g, i in sorted(model)]
    for limit in (7, 100, 1000):
        assert _model_pages(conn, schema, b, limit) == want
    for _ in range(40):  # from any failed or unfailed item
        g = rng.choice(list(sizes))
        i = rng.randrange(sizes[g])
        lim = rng.choice([1, 3, 50, 1000])
        page = tracker.failures(conn, b, after=f"{b.id}:{g}:{i}", limit=lim, schema=schema)
        assert page.items == [w for w in want if tuple(map(int, w[0].split(":")[1:])) > (g, i)][:lim]
    counts = conn.execute(
        "SELECT g.id, g.failed, coalesce(sum(coalesce(cardinality(f.items), bit_count(f.bits))), 0)"
        " FROM batch_group g LEFT JOIN group_failure f ON f.batch_id = g.batch_id AND f.group_id = g.id"
        " GROUP BY g.id, g.failed"
    ).fetchall()
    assert all(stored == failed for _, failed, stored in counts)
    assert sum(c[1] for c in counts) == len(model)


def _page_buffers(conn, batch: int, after: str | None, limit: int) -> int:
    plan = conn.execute(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT * FROM failures(%s, %s, %s)", [batch, after, limit]
    ).fetchone()[0][0]["Plan"]
    return plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0)


def test_a_page_reads_what_it_returns_not_every_reason_of_the_group(conn, schema):
    """512 items of one group, each failed with its own reason: a page of 10, from the start or
    the middle, reads a few dozen buffers; reading each of the group's rows would take 512 and
    more (EXPLAIN's buffer counts include what the function's own statements read)."""
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, 8192, schema=schema)
    conn.commit()
    conn.execute(
        "SELECT fail(ARRAY[%s || ':0:' || i], 'request ' || i || ' failed: HTTP 503') FROM generate_series(0, 8191, 16) i",
        [b.id],
    )
    conn.commit()
    assert conn.execute("SELECT count(*) FROM group_failure").fetchone() == (512,)
    # Count what a page reads, not the set-up's dead row versions nor a re-planning: statistics
    # taken now (an autovacuum ANALYZE midway would invalidate the cached plans, and planning
    # reads the catalogs), then the plans cached by one page from each cursor.
    conn.commit()
    conn.autocommit = True
    conn.execute("VACUUM (ANALYZE) batch, batch_group, group_failure, failure_reason")
    conn.autocommit = False
    cursors = (None, f"{b.id}:0:4000", f"{b.id}:0:8159")
    for after in cursors:
        conn.execute("SELECT * FROM failures(%s, %s, 10)", [b.id, after]).fetchall()
    for after in cursors:
        assert _page_buffers(conn, b.id, after, 10) < 150
    page = tracker.failures(conn, b, after=f"{b.id}:0:4000", limit=3, schema=schema)
    assert page.items == [(f"{b.id}:0:{i}", f"request {i} failed: HTTP 503") for i in (4016, 4032, 4048)]
