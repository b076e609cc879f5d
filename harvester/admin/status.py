"""`reaper outbox status`: backlog, oldest age, rows in flight and dead, and who leads each unit.

A *unit* is what one leader harvests. Today a deployment has one unit (unit 0: the configured
outbox table), led by the holder of partition 0 of the leader topic; with several units (one
leader-topic partition each) the holder of partition u leads unit u. The leader is read from
the leader group's assignment (Kafka's view): the holder leads unless it has fenced itself, and
the leader ids in `marked_by` (rows in flight under each id) say who is publishing right now.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient
from psycopg import sql

from harvester import logs
from harvester.admin.common import AdminError, duration, one_row, require_tables
from harvester.config import Config
from harvester.exit_codes import ExitCode
from harvester.publishing.outbox_sql import BACKLOG_EXACT
from tracker.schema import qualified


@dataclass
class UnitStatus:
    unit: int
    table: str
    backlog_rows: int
    backlog_exact: bool  # False: above BACKLOG_EXACT, the id span (an upper bound)
    oldest_age_seconds: float
    in_flight_rows: int  # marked by a leader id, not yet purged or reset
    marked_by: dict[str, int]  # leader id -> rows in flight under it
    dead_rows: int
    leader: dict[str, Any] | None = None  # holder of the unit's leader-topic partition


@dataclass
class OutboxStatus:
    units: list[UnitStatus]
    batches: dict[str, int]
    items_pending: int
    leader_group: str
    leader_topic: str
    group_state: str | None = None
    kafka_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def unit_status(
    conn: psycopg.Connection, schema: str, table: str, unit: int = 0, *, exact_up_to: int = BACKLOG_EXACT
) -> UnitStatus:
    """One outbox table's figures, each read from at most `exact_up_to` + 1 rows (or by index)."""
    require_tables(conn, schema, table, f"{table}_dead")
    t, dead = qualified(schema, table), qualified(schema, f"{table}_dead")
    # The same bounded count as the backlog gauge: exact up to `exact_up_to`, above it the id span.
    rows = one_row(
        conn.execute(sql.SQL("SELECT count(*) FROM (SELECT 1 FROM {} LIMIT %s) s").format(t), [exact_up_to + 1])
    )[0]
    exact = rows <= exact_up_to
    if not exact:
        span = one_row(conn.execute(sql.SQL("SELECT max(id) - min(id) + 1 FROM {}").format(t)))[0]
        rows = max(exact_up_to + 1, span or 0)
    oldest = conn.execute(
        sql.SQL("SELECT extract(epoch FROM clock_timestamp() - created_at) FROM {} ORDER BY id LIMIT 1").format(t)
    ).fetchone()
    # Rows in flight among the first rows by id: a leader marks the lowest ids, so its rows are
    # there. (Looking for marked rows anywhere would read the whole table when few are marked.)
    marked = conn.execute(
        sql.SQL(
            "SELECT leader_id::text, count(*) FROM (SELECT leader_id FROM {} ORDER BY id LIMIT %s) s "
            "WHERE leader_id IS NOT NULL GROUP BY 1 ORDER BY 2 DESC"
        ).format(t),
        [exact_up_to + 1],
    ).fetchall()
    dead_rows = one_row(conn.execute(sql.SQL("SELECT count(*) FROM {}").format(dead)))[0]
    return UnitStatus(
        unit=unit,
        table=f"{schema}.{table}",
        backlog_rows=rows,
        backlog_exact=exact,
        oldest_age_seconds=max(0.0, float(oldest[0])) if oldest else 0.0,
        in_flight_rows=sum(n for _, n in marked),
        marked_by=dict(marked),
        dead_rows=dead_rows,
    )


def batch_counts(conn: psycopg.Connection, schema: str) -> tuple[dict[str, int], int]:
    require_tables(conn, schema, "batch")
    b = qualified(schema, "batch")
    counts: dict[str, int] = dict(
        conn.execute(sql.SQL("SELECT state, count(*) FROM {} GROUP BY state").format(b)).fetchall()
    )
    pending = one_row(
        conn.execute(sql.SQL("SELECT coalesce(sum(pending), 0) FROM {} WHERE state IN ('open', 'closed')").format(b))
    )[0]
    return {s: counts.get(s, 0) for s in ("open", "closed", "complete", "expired")}, int(pending)


def leaders(cfg: Config, timeout: float) -> tuple[dict[int, dict[str, Any]], str]:
    """Partition -> the leader-group member assigned it, and the group's state (Kafka's view)."""
    h = cfg.harvester
    conf = {"bootstrap.servers": cfg.kafka.bootstrap_servers, **cfg.kafka.client, "logger": logs.KafkaLogger("admin")}
    admin = AdminClient(conf)
    try:
        future = admin.describe_consumer_groups([h.leader_group], request_timeout=timeout)[h.leader_group]
        desc = future.result(timeout=timeout + 5)
    finally:
        admin.poll(0)  # an admin client's log lines wait for a poll: hand them to structlog
    out: dict[int, dict[str, Any]] = {}
    for m in desc.members:
        for tp in m.assignment.topic_partitions if m.assignment else []:
            if tp.topic == h.leader_topic:
                out[tp.partition] = {"member_id": m.member_id, "client_id": m.client_id, "host": m.host}
    return out, desc.state.name.lower()


def outbox_status(cfg: Config, conn: psycopg.Connection, timeout: float) -> OutboxStatus:
    db = cfg.database
    unit = unit_status(conn, db.schema, db.outbox_table)
    batches, pending = batch_counts(conn, db.schema)
    conn.rollback()  # read only: end the snapshot
    status = OutboxStatus(
        units=[unit],
        batches=batches,
        items_pending=pending,
        leader_group=cfg.harvester.leader_group,
        leader_topic=cfg.harvester.leader_topic,
    )
    try:
        holders, status.group_state = leaders(cfg, timeout)
    except Exception as exc:  # KafkaException, or a timeout: the database part still stands
        status.kafka_error = f"{type(exc).__name__}: {exc}"
        return status
    for u in status.units:
        u.leader = holders.get(u.unit)
    return status


def render(status: OutboxStatus) -> str:
    lines = []
    for u in status.units:
        approx = "" if u.backlog_exact else " (estimate: id span)"
        lines += [
            f"unit {u.unit}: {u.table}",
            f"  backlog         {u.backlog_rows} rows{approx}",
            f"  oldest row      {duration(u.oldest_age_seconds)} old" if u.backlog_rows else "  oldest row      -",
            f"  in flight       {u.in_flight_rows} rows",
        ]
        for leader_id, n in u.marked_by.items():
            lines.append(f"    marked by     {leader_id}: {n}")
        lines.append(f"  dead            {u.dead_rows} rows (reaper dead list)")
        if status.kafka_error:
            lines.append(f"  leader          unknown: {status.kafka_error}")
        elif u.leader is None:
            lines.append(f"  leader          none (group {status.leader_group!r} is {status.group_state})")
        else:
            ld = u.leader
            lines.append(f"  leader          {ld['host']} client {ld['client_id']!r} member {ld['member_id']}")
    b = status.batches
    lines.append(
        f"batches: {b['open']} open, {b['closed']} closed, {b['complete']} complete, {b['expired']} expired; "
        f"{status.items_pending} items pending"
    )
    return "\n".join(lines)


def exit_code(status: OutboxStatus) -> ExitCode:
    return ExitCode.UNAVAILABLE if status.kafka_error else ExitCode.OK


__all__ = ["OutboxStatus", "UnitStatus", "outbox_status", "render", "exit_code", "AdminError"]
