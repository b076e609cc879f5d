"""`reaper batch show ID` and `reaper batch expire ID`.

`show` reads the batch row, its group counts and the pending items as runs
(`<batch>:<group>:<start>-<end>`), a page at a time: `--after <item id>` continues after that
item. Runs are found from the groups' bitfields in Python, a few dozen groups per query, so a page
costs what it shows, not what the batch holds. It also shows the batch's outcome and counts
(tracker.status), its parent and first children, and a page of its failed items with their
reasons (tracker.failures; `--failures-after <item id>` continues after that item).
`expire` expires an open or closed batch now, writes its expiry event through the outbox (the
sweeper's event, reason "operator") and records the action in `admin_log`, in one transaction.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from harvester.admin.common import AdminError, ago, one_row, require_tables, when
from harvester.config import Config
from harvester.exit_codes import ExitCode
from tracker import Tracker
from tracker.errors import UnknownBatch
from tracker.expiry import BatchNotExpirable, Expired, expire_batch
from tracker.ids import ItemId, format_item_id, format_run
from tracker.schema import qualified

GROUPS_PER_QUERY = 32  # 32 x 1 KiB bitfields per round trip
CHILDREN_SHOWN = 20  # the first children (by id) a view lists; `children` counts them all
_RUN = re.compile("1+")


@dataclass
class BatchView:
    id: int
    user_key: str | None
    state: str
    total: int
    pending: int
    acked: int
    groups: int
    groups_pending: int
    completion_topic: str | None
    created_at: dt.datetime
    closed_at: dt.datetime | None
    completed_at: dt.datetime | None
    expired_at: dt.datetime | None
    last_activity_at: dt.datetime
    now: dt.datetime
    outcome: str | None = None  # once complete: succeeded or failed
    succeeded: int = 0
    failed: int = 0
    late: int = 0  # outcomes recorded after it finished
    parent_id: int | None = None
    children: int = 0
    children_open: int = 0
    children_failed: int = 0
    child_ids: list[int] = field(default_factory=list)  # the first CHILDREN_SHOWN, by id
    pending_runs: list[str] = field(default_factory=list)
    next_after: str | None = None  # pass as --after for the next page; None: last page
    failures: list[dict[str, str]] = field(default_factory=list)  # {item_id, reason}, in item order
    failures_next: str | None = None  # pass as --failures-after for the next page; None: last page


def show(
    conn: psycopg.Connection,
    schema: str,
    batch_id: int,
    *,
    after: ItemId | None = None,
    limit: int = 100,
    failures_after: ItemId | None = None,
    failures_limit: int = 20,
) -> BatchView:
    require_tables(conn, schema, "batch", "batch_group")
    b, g = qualified(schema, "batch"), qualified(schema, "batch_group")
    row = conn.execute(
        sql.SQL(
            "SELECT user_key, state, total, pending, completion_topic, created_at, closed_at, completed_at, expired_at, "
            "last_activity_at, clock_timestamp() FROM {} WHERE id = %s"
        ).format(b),
        [batch_id],
    ).fetchone()
    if row is None:
        conn.rollback()
        raise AdminError(f"unknown batch {batch_id}", ExitCode.NOT_FOUND)
    groups, groups_pending = one_row(
        conn.execute(
            sql.SQL("SELECT count(*), count(*) FILTER (WHERE pending > 0) FROM {} WHERE batch_id = %s").format(g),
            [batch_id],
        )
    )
    view = BatchView(batch_id, row[0], row[1], row[2], row[3], row[2] - row[3], groups, groups_pending, *row[4:])
    t = Tracker(schema=schema)
    st = t.status(conn, batch_id)
    view.outcome, view.succeeded, view.failed, view.late = st.outcome, st.succeeded, st.failed, st.late
    view.parent_id, view.children_open = st.parent_id, st.children_open
    view.children, view.children_failed = st.children, st.children_failed
    if view.children:
        kids = conn.execute(
            sql.SQL("SELECT id FROM {} WHERE parent_id = %s ORDER BY id LIMIT %s").format(b),
            [batch_id, CHILDREN_SHOWN],
        ).fetchall()
        view.child_ids = [r[0] for r in kids]
    page_of_failures = t.failures(
        conn, batch_id, after=None if failures_after is None else str(failures_after), limit=failures_limit
    )
    view.failures = [{"item_id": i, "reason": r} for i, r in page_of_failures.items]
    view.failures_next = page_of_failures.next
    view.pending_runs, view.next_after = pending_runs(conn, schema, batch_id, after, limit)
    conn.rollback()
    return view


def runs_statement(schema: str) -> sql.Composed:
    """A page of the batch's groups with pending items from a group id on: (batch id, from, limit)."""
    return sql.SQL(
        "SELECT id, bits::text FROM {} WHERE batch_id = %s AND id >= %s AND pending > 0 ORDER BY id LIMIT %s"
    ).format(qualified(schema, "batch_group"))


def runs_from(after: ItemId | None) -> tuple[int, int]:
    """The group id and the index in it that a page of pending items after `after` starts at."""
    return (after.group_id, after.index + 1) if after else (0, 0)


def pending_runs(
    conn: psycopg.Connection,
    schema: str,
    batch_id: int,
    after: ItemId | None,
    limit: int,
    first: list[tuple[int, str]] | None = None,
) -> tuple[list[str], str | None]:
    """A page of the batch's pending items as runs after `after`, and the cursor of the next page
    (None: last page). `first`: the first GROUPS_PER_QUERY groups from runs_statement, already read."""
    # Runs of set (pending) bits, group by group from the cursor, until the page is full plus one.
    group_from, index_from = runs_from(after)
    runs: list[tuple[int, int, int]] = []
    page = runs_statement(schema)
    while len(runs) <= limit:
        if first is not None:
            found, first = first, None
        else:
            found = conn.execute(page, [batch_id, group_from, GROUPS_PER_QUERY]).fetchall()
        for group_id, bits in found:
            start_at = index_from if group_id == group_from else 0
            for m in _RUN.finditer(bits, start_at):
                runs.append((group_id, m.start(), m.end() - 1))
                if len(runs) > limit:
                    break
            if len(runs) > limit:
                break
        if len(found) < GROUPS_PER_QUERY or len(runs) > limit:
            break
        group_from, index_from = found[-1][0] + 1, 0
    next_after = None
    if len(runs) > limit:
        gid, _, end = runs[limit - 1]
        next_after = format_item_id(batch_id, gid, end)
    return [format_run(batch_id, *r) for r in runs[:limit]], next_after


def expire(cfg: Config, conn: psycopg.Connection, batch_id: int, note: str | None) -> Expired | None:
    db = cfg.database
    require_tables(conn, db.schema, "batch", db.outbox_table, "admin_log")
    try:
        got = expire_batch(
            conn,
            batch_id,
            schema=db.schema,
            reason="operator",
            note=note,
            outbox_table=db.outbox_table,
            completion_topic=cfg.harvester.default_completion_topic,
            expiry_topic=cfg.sweeper.expiry_topic or None,
            metrics_prefix=cfg.metrics.prefix,
        )
    except UnknownBatch:
        conn.rollback()
        raise AdminError(f"unknown batch {batch_id}", ExitCode.NOT_FOUND) from None
    except BatchNotExpirable as exc:
        conn.rollback()
        raise AdminError(str(exc), ExitCode.REFUSED) from None
    if got is not None:
        conn.execute(
            sql.SQL("INSERT INTO {} (action, rows, detail) VALUES ('batch-expire', 1, %s::jsonb)").format(
                qualified(db.schema, "admin_log")
            ),
            [
                json.dumps(
                    {"batch_id": batch_id, "note": note, "topic": got.topic, "pending": got.pending, "total": got.total}
                )
            ],
        )
    conn.commit()
    return got


def render(v: BatchView) -> str:
    lines = [
        f"batch {v.id}" + (f"  user key {v.user_key!r}" if v.user_key is not None else ""),
        f"  state          {v.state}",
        f"  outcome        {v.outcome or '-'}",
        f"  items          {v.total} total, {v.pending} pending, {v.succeeded} succeeded, {v.failed} failed"
        + (f" ({v.late} late)" if v.late else ""),
        f"  groups         {v.groups} ({v.groups_pending} with pending items)",
        f"  completion to  {v.completion_topic or '(the default completion topic)'}",
        f"  opened         {when(v.created_at)}{ago(v.created_at, v.now)}",
        f"  closed         {when(v.closed_at)}{ago(v.closed_at, v.now)}",
    ]
    if v.completed_at:
        lines.append(f"  completed      {when(v.completed_at)}{ago(v.completed_at, v.now)}")
    if v.expired_at:
        lines.append(f"  expired        {when(v.expired_at)}{ago(v.expired_at, v.now)}")
    lines.append(f"  last activity  {when(v.last_activity_at)}{ago(v.last_activity_at, v.now)}")
    if v.parent_id is not None:
        lines.append(f"  parent         {v.parent_id}")
    if v.children:
        more = f" (first {len(v.child_ids)})" if len(v.child_ids) < v.children else ""
        lines.append(
            f"  children       {v.children} ({v.children_open} not finished, {v.children_failed} failed): "
            + ", ".join(map(str, v.child_ids))
            + more
        )
    if v.failures:
        lines.append(f"  failed items ({len(v.failures)} on this page):")
        lines += [f"    {f['item_id']}  {f['reason']!r}" for f in v.failures]
    if v.failures_next:
        lines.append(f"  next failures: reaper batch show {v.id} --failures-after {v.failures_next}")
    if v.pending_runs:
        lines.append(f"  pending items ({len(v.pending_runs)} runs on this page):")
        lines += [f"    {r}" for r in v.pending_runs]
    elif v.pending:
        lines.append("  pending items: none after the given --after")
    if v.next_after:
        lines.append(f"  next page: reaper batch show {v.id} --after {v.next_after}")
    return "\n".join(lines)


def render_expired(batch_id: int, got: Expired | None) -> str:
    if got is None:
        return f"batch {batch_id} was already expired: nothing changed"
    return (
        f"batch {batch_id} expired ({got.pending} of {got.total} items pending); "
        f"expiry event written to the outbox for topic {got.topic!r}"
    )
