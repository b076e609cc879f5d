"""A batch's page reads the database in a few round trips, whatever it shows (the batch, its
groups, children, failures and pending items), on real Postgres; its two page cursors (failures,
pending items) each stay where the reader left them when the other moves or the page refreshes."""

from __future__ import annotations

import re

import psycopg
import pytest
from support.console_server import cfg, client, server  # noqa: F401 (fixtures)
from support.http_server import TOKEN
from support.pg_trace import traced

import tracker
from harvester.services.console import batch_page
from tracker.ids import parse_item_id


@pytest.fixture
def family(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        parent = tracker.open_batch(conn, user_key="family", schema=schema)
        tracker.add_items(conn, parent, 20_000, schema=schema)  # 3 groups
        tracker.ack(conn, [f"{parent.id}:0:0-99"], schema=schema, claims=False)
        tracker.fail(conn, [f"{parent.id}:0:100", f"{parent.id}:1:5"], "image missing", schema=schema)
        kids = [tracker.open_batch(conn, parent=parent, schema=schema).id for _ in range(3)]
    return parent.id, kids


def test_a_batch_page_reads_in_at_most_two_round_trips(pg_dsn, schema, tmp_path, family):
    batch_id, kids = family
    got, trips = traced(
        pg_dsn,
        tmp_path,
        lambda c: batch_page.read(c, schema, "default", batch_id, after=None, failures_after=None, limit=3),
    )
    assert got is not None
    view, children = got
    assert [c.id for c in children] == kids and view.children == 3
    assert view.failures == [
        {"item_id": f"{batch_id}:0:100", "reason": "image missing"},
        {"item_id": f"{batch_id}:1:5", "reason": "image missing"},
    ]
    assert view.pending_runs == [f"{batch_id}:0:101-8191", f"{batch_id}:1:0-4", f"{batch_id}:1:6-8191"]
    assert view.next_after == f"{batch_id}:1:8191" and view.failures_next is None
    assert (view.total, view.pending, view.failed, view.groups, view.groups_pending) == (20_000, 19_898, 2, 3, 3)
    assert trips <= 2, trips  # it was 15 or so: one per read, plus a rollback after each


def test_the_next_pages_and_an_unknown_or_foreign_batch_read_as_few(pg_dsn, schema, tmp_path, family):
    batch_id, _ = family
    after, fafter = parse_item_id(f"{batch_id}:1:8191"), parse_item_id(f"{batch_id}:0:100")
    got, trips = traced(
        pg_dsn,
        tmp_path,
        lambda c: batch_page.read(c, schema, "default", batch_id, after=after, failures_after=fafter, limit=3),
    )
    assert got is not None and trips <= 2, trips
    view, _ = got
    assert view.pending_runs == [f"{batch_id}:2:0-{20_000 - 2 * 8192 - 1}"] and view.next_after is None
    assert view.failures == [{"item_id": f"{batch_id}:1:5", "reason": "image missing"}]
    for tenant, bid in (("default", 987654321), ("billing", batch_id)):
        got, trips = traced(
            pg_dsn,
            tmp_path,
            lambda c: batch_page.read(c, schema, tenant, bid, after=None, failures_after=None, limit=3),
        )
        assert got is None and trips <= 2, (tenant, trips)


def test_a_failures_cursor_of_another_batch_is_a_bad_cursor(pg_dsn, schema, family):
    batch_id, kids = family
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(batch_page.BadCursor):
            batch_page.read(
                conn, schema, "default", batch_id, after=None, failures_after=parse_item_id(f"{kids[0]}:0:1"), limit=3
            )
        assert conn.execute("SELECT 1").fetchone() == (1,)  # the connection is still usable


def _reasons(page: str) -> list[str]:
    return re.findall(r"<td>(reason \d)</td>", page)


def _runs(page: str) -> list[str]:
    return re.findall(r"<li><code>(\d+:\d+:[\d-]+)</code></li>", page)


def _href(page: str, text: str) -> str:
    found = re.search(r'<a (?:rel="next" )?href="([^"]+)">' + text, page)
    assert found, f"no link {text!r} in the page"
    return found.group(1).replace("&amp;", "&")


def _live(page: str) -> str:
    return re.search(r'data-live="([^"]+)"', page).group(1).replace("&amp;", "&")


def test_each_page_cursor_stays_put_when_the_other_moves_or_the_page_refreshes(server, pg_dsn, schema):
    """Pages of 3 (the console fixture's page_size): 5 failures make two pages of failures, the
    runs between them and after them three pages of pending items."""
    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 10_000, schema=schema)
        for k in range(5):
            tracker.fail(conn, [f"{b.id}:0:{100 * (k + 1)}"], f"reason {k}", schema=schema)
    c = client(server, TOKEN)
    first = c.get(f"/console/batches/{b.id}").text
    assert _reasons(first) == ["reason 0", "reason 1", "reason 2"]
    first_runs = _runs(first)
    assert len(first_runs) == 3

    failures_2 = c.get(_href(first, "More failures")).text
    assert _reasons(failures_2) == ["reason 3", "reason 4"] and _runs(failures_2) == first_runs
    refreshed = c.get(_live(failures_2)).text
    assert "<html" not in refreshed
    assert _reasons(refreshed) == ["reason 3", "reason 4"] and _runs(refreshed) == first_runs

    both_moved = c.get(_href(failures_2, "More pending items")).text
    second_runs = _runs(both_moved)
    assert second_runs and not set(second_runs) & set(first_runs)
    assert _reasons(both_moved) == ["reason 3", "reason 4"]
    refreshed = c.get(_live(both_moved)).text
    assert _reasons(refreshed) == ["reason 3", "reason 4"] and _runs(refreshed) == second_runs

    # From the first page of failures, with the pending items moved on, to the next failures.
    pending_2 = c.get(_href(first, "More pending items")).text
    assert _runs(pending_2) == second_runs and _reasons(pending_2) == _reasons(first)
    assert _runs(c.get(_href(pending_2, "More failures")).text) == second_runs
