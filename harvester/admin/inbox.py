"""`reaper inbox show <message-id>` and `reaper inbox status`: where a message id is recorded, and
the inbox's partitions. Both only read (through the SQL functions inbox_show and inbox_partitions,
tracker.inbox.retention); `show` probes the (consumer, id) index of each partition, never reads
one whole."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

import psycopg

from harvester.admin.common import ago, duration, require_tables, when
from tracker.inbox import retention


@dataclass
class InboxShow:
    message_id: str
    consumer: str | None  # the one asked about, or None: every consumer
    recorded: list[retention.Recorded]


@dataclass
class InboxStatus:
    partitions: list[retention.Partition]
    bytes: int
    ids_estimate: int
    oldest_holding: dt.datetime | None  # start of the oldest partition holding ids
    newest_upper: dt.datetime | None  # claims fail past this time unless the maintenance runs


def show(conn: psycopg.Connection, schema: str, message_id: str, consumer: str | None) -> InboxShow:
    require_tables(conn, schema, "inbox", "inbox_partition")
    got = retention.show(conn, message_id, consumer=consumer, schema=schema)
    conn.rollback()
    return InboxShow(message_id, consumer, got)


def status(conn: psycopg.Connection, schema: str) -> InboxStatus:
    require_tables(conn, schema, "inbox", "inbox_partition")
    parts = retention.partitions(conn, schema=schema)
    conn.rollback()
    holding = [p for p in parts if p.holds_ids]
    return InboxStatus(
        parts,
        sum(p.bytes for p in parts),
        sum(p.rows_estimate for p in parts),
        holding[0].lower if holding else None,
        max((p.upper for p in parts if p.attached), default=None),
    )


def render_show(v: InboxShow) -> str:
    who = f" by consumer {v.consumer!r}" if v.consumer is not None else ""
    if not v.recorded:
        return f"message {v.message_id!r}: not recorded{who} (never processed, or older than the retention window)"
    now = dt.datetime.now(dt.UTC)
    lines = [f"message {v.message_id!r}: processed{who}"]
    for r in v.recorded:
        lines.append(f"  {r.consumer:<30} {when(r.received_at)}{ago(r.received_at, now)}  partition {r.partition}")
    return "\n".join(lines)


def render_status(s: InboxStatus) -> str:
    now = dt.datetime.now(dt.UTC)
    lines = [
        f"partitions:   {len(s.partitions)}",
        f"ids:          ~{s.ids_estimate:,} (table statistics)",
        f"size:         {s.bytes:,} bytes",
        f"oldest ids:   received since {when(s.oldest_holding)}{ago(s.oldest_holding, now)} (that partition's start)",
        f"covered until {when(s.newest_upper)}"
        + (f" (in {duration((s.newest_upper - now).total_seconds())})" if s.newest_upper else ""),
        "",
        f"  {'partition':<28} {'from':<23} {'to':<23} {'ids':>10} {'bytes':>12}  state",
    ]
    for p in s.partitions:
        state = "attached" if p.attached else "detaching"
        lines.append(
            f"  {p.name:<28} {when(p.lower):<23} {when(p.upper):<23} {p.rows_estimate:>10,} {p.bytes:>12,}  {state}"
        )
    return "\n".join(lines)
