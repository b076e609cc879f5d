"""What a batch's page reads: the batch, its groups' counts, its first children, a page of its
failed items and a page of its pending items (runs), all sent at once (reads.read_all): one round
trip to the database, and a second only when the first GROUPS_PER_QUERY groups with pending items
do not fill the page of runs (then batch_admin.pending_runs goes on, GROUPS_PER_QUERY at a time).

The figures are those of `reaper batch show` (harvester.admin.batch), read from the same places:
the batch row (its counts, outcome and children's counts, as tracker.status reads them), the
group table, and the SQL API's failures() for the failed items.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from harvester.admin import batch as batch_admin
from harvester.services.console import queries
from harvester.services.console.reads import read_all
from tracker.ids import ItemId
from tracker.schema import qualified


class BadCursor(ValueError):
    """A page cursor that is not an item id of the batch."""


def _statements(schema: str) -> dict[str, sql.Composed]:
    b, g = qualified(schema, "batch"), qualified(schema, "batch_group")
    return {
        # As batch_admin.show and tracker.status read it (an old complete batch without an outcome succeeded).
        "batch": sql.SQL(
            "SELECT coalesce(tenant, 'default'), user_key, state, total, pending, completion_topic, created_at, "
            "closed_at, completed_at, expired_at, last_activity_at, clock_timestamp(), "
            "coalesce(outcome, CASE WHEN state = 'complete' THEN 'succeeded' END), failed, late, parent_id, "
            "children_open, children, children_failed FROM {} WHERE id = %s"
        ).format(b),
        "groups": sql.SQL("SELECT count(*), count(*) FILTER (WHERE pending > 0) FROM {} WHERE batch_id = %s").format(g),
        "failures": sql.SQL("SELECT item_id, reason FROM {}(%s::int8, %s::text, %s::int4)").format(
            qualified(schema, "failures")
        ),
    }


def read(
    conn: psycopg.Connection,
    schema: str,
    tenant: str,
    batch_id: int,
    *,
    after: ItemId | None,
    failures_after: ItemId | None,
    limit: int,
) -> tuple[batch_admin.BatchView, list[queries.BatchRow]] | None:
    """The batch's view and its first children; None when there is no such batch for `tenant`
    (another tenant's batch reads as one that does not exist)."""
    q = _statements(schema)
    group_from, _ = batch_admin.runs_from(after)
    children_q, children_p = queries.children_statement(schema, tenant, batch_id, batch_admin.CHILDREN_SHOWN)
    conn.rollback()  # a pool's connection is idle: make sure of it
    got = read_all(
        conn,
        [
            (q["batch"], [batch_id]),
            (q["groups"], [batch_id]),
            (children_q, children_p),
            (q["failures"], [batch_id, None if failures_after is None else str(failures_after), limit]),
            (batch_admin.runs_statement(schema), [batch_id, group_from, batch_admin.GROUPS_PER_QUERY]),
        ],
    )
    batch, groups, children, failures, runs = got
    if isinstance(batch, psycopg.Error):
        raise batch
    if not batch or batch[0][0] != tenant:
        return None
    if isinstance(failures, psycopg.Error) and failures.sqlstate == "RT007":
        raise BadCursor(str(failures))  # `fafter` is an item id, but not one of this batch
    for answer in (groups, children, failures, runs):
        if isinstance(answer, psycopg.Error):
            raise answer  # the batch exists: a failed read here is the page's error
    assert not isinstance(groups, psycopg.Error) and not isinstance(children, psycopg.Error)
    assert not isinstance(failures, psycopg.Error) and not isinstance(runs, psycopg.Error)
    (_, user_key, state, total, pending, *times, outcome, failed, late, parent_id, c_open, c_all, c_failed) = batch[0]
    n_groups, n_pending = groups[0]
    view = batch_admin.BatchView(
        batch_id, user_key, state, total, pending, total - pending, n_groups, n_pending, *times
    )
    view.outcome, view.succeeded, view.failed, view.late = outcome, total - pending - failed, failed, late
    view.parent_id, view.children_open, view.children, view.children_failed = parent_id, c_open, c_all, c_failed
    kids = [queries.BatchRow(*r) for r in children]
    view.child_ids = [k.id for k in kids]
    view.failures = [{"item_id": i, "reason": r} for i, r in failures]
    view.failures_next = failures[-1][0] if len(failures) == limit else None
    first = [(int(r[0]), str(r[1])) for r in runs]
    view.pending_runs, view.next_after = batch_admin.pending_runs(conn, schema, batch_id, after, limit, first)
    conn.rollback()  # only when more groups were read: end that snapshot
    return view, kids
