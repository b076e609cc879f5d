"""`reaper outbox status`: backlog, oldest age, rows in flight and dead, and who leads each unit.

A *unit* is what one leader harvests: one outbox table, or one lane of it (harvester.config.units:
the `database` section's outbox, or every entry of harvester.outboxes, each in its lanes). The
holder of leader-topic partition u leads unit u; every unit of the configuration is reported,
each read from its own database (an outbox entry may name another DSN). The leader is read from
the leader group's assignment (Kafka's view): the holder leads unless it has fenced itself, and
the leader ids in `marked_by` (rows in flight under each id) say who is publishing right now.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from psycopg import sql

from harvester import logs
from harvester.admin import dead as dead_mod
from harvester.admin.common import AdminError, duration, one_row, require_tables
from harvester.batch_census import batch_census
from harvester.config import Config, redact_dsn, units
from harvester.exit_codes import ExitCode
from harvester.publishing.outbox_sql import BACKLOG_EXACT, LANE_SQL
from harvester.publishing.publisher import logs_safe
from tracker.schema import qualified

DEAD_EXACT = 10_000  # dead rows are counted up to this; above it the status says "more than"


@dataclass
class UnitStatus:
    unit: int
    table: str
    backlog_rows: int
    backlog_exact: bool  # False: above BACKLOG_EXACT, the id span (an upper bound)
    oldest_age_seconds: float
    in_flight_rows: int  # marked by a leader id, not yet purged or reset
    marked_by: dict[str, int]  # leader id -> rows in flight under it
    dead_rows: int  # counted up to DEAD_EXACT: with dead_rows_capped, there are more than this
    leader: dict[str, Any] | None = None  # holder of the unit's leader-topic partition
    name: str = "default"  # the unit's name (harvester.config.UnitSpec.name)
    lane: int = 0  # rows whose key hashes to this lane (of `lanes`): see harvester.publishing.outbox_sql.lane_of
    lanes: int = 1
    error: str | None = None  # its database could not be read
    dead_rows_capped: bool = False  # True: more than dead_rows (the count stopped at its cap)
    oldest_id: int | None = None  # the oldest row (lowest id) of the unit's backlog, if any
    oldest_topic: str | None = None  # ... its topic
    oldest_marked_by: str | None = None  # ... the leader id it is marked with (None: not in flight)
    dead_command: str = "reaper dead list"  # the command that lists its dead rows (their outbox's)


@dataclass
class OutboxStatus:
    units: list[UnitStatus]
    batches: dict[str, int]
    items_pending: int
    leader_group: str
    leader_topic: str
    group_state: str | None = None
    kafka_error: str | None = None
    batches_estimated: list[str] = field(default_factory=list)  # states counted by the planner's estimate

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def unit_status_statement(
    schema: str,
    table: str,
    lane: int = 0,
    lanes: int = 1,
    *,
    exact_up_to: int = BACKLOG_EXACT,
    dead_exact_up_to: int = DEAD_EXACT,
) -> tuple[sql.Composed, dict[str, object]]:
    """The one statement that reads a unit's figures (see unit_status), and its parameters: a row of
    (rows counted up to exact_up_to + 1, the id span, the oldest row's age, [[leader id, rows in
    flight], ...] or NULL, dead rows counted up to dead_exact_up_to + 1)."""
    t, dead = qualified(schema, table), qualified(schema, f"{table}_dead")
    where = sql.SQL("")
    if lanes > 1:
        where = sql.SQL(" WHERE " + LANE_SQL.format(lanes=int(lanes)) + " = %(lane)s")
    statement = sql.SQL(
        # The same bounded count as the backlog gauge: exact up to `exact_up_to`, above it the id span
        # (two probes of the primary key).
        "SELECT (SELECT count(*) FROM (SELECT 1 FROM {t}{w} LIMIT %(cap)s) s), "
        "(SELECT max(id) - min(id) + 1 FROM {t}), "
        # The oldest row: its age, id, topic and the leader id it is marked with (the row a stall
        # is stuck on, e.g. one whose topic does not exist).
        "(SELECT json_build_array(extract(epoch FROM clock_timestamp() - created_at), id, topic, leader_id::text) "
        "FROM {t}{w} ORDER BY id LIMIT 1), "
        # Rows in flight among the unit's first rows by id: a leader marks the lowest ids, so its rows
        # are there. (Looking for marked rows anywhere would read the whole table when few are marked.)
        "(SELECT json_agg(json_build_array(l, n) ORDER BY n DESC, l) FROM (SELECT leader_id::text AS l, "
        "count(*) AS n FROM (SELECT leader_id FROM {t}{w} ORDER BY id LIMIT %(cap)s) s "
        "WHERE leader_id IS NOT NULL GROUP BY 1) m), "
        # Dead rows: a bounded count too (a dead table may grow large while Kafka refuses a topic).
        "(SELECT count(*) FROM (SELECT 1 FROM {dead}{w} LIMIT %(dead_cap)s) d)"
    ).format(t=t, dead=dead, w=where)
    return statement, {"cap": exact_up_to + 1, "dead_cap": dead_exact_up_to + 1, "lane": lane}


def unit_status_of(
    row: tuple[Any, ...],
    schema: str,
    table: str,
    unit: int = 0,
    lane: int = 0,
    lanes: int = 1,
    *,
    exact_up_to: int = BACKLOG_EXACT,
    dead_exact_up_to: int = DEAD_EXACT,
) -> UnitStatus:
    """The UnitStatus of a row that unit_status_statement returned."""
    rows, span, oldest, marked, dead_rows = row
    age, oldest_id, oldest_topic, oldest_marked_by = oldest if oldest is not None else (None, None, None, None)
    exact = rows <= exact_up_to
    if not exact:
        rows = max(exact_up_to + 1, span or 0)
    marked_by = {str(leader): int(n) for leader, n in marked or []}
    return UnitStatus(
        unit=unit,
        table=f"{schema}.{table}",
        backlog_rows=rows,
        backlog_exact=exact,
        oldest_age_seconds=max(0.0, float(age)) if age is not None else 0.0,
        oldest_id=oldest_id,
        oldest_topic=oldest_topic,
        oldest_marked_by=oldest_marked_by,
        in_flight_rows=sum(marked_by.values()),
        marked_by=marked_by,
        dead_rows=min(int(dead_rows), dead_exact_up_to),
        dead_rows_capped=dead_rows > dead_exact_up_to,
        lane=lane,
        lanes=lanes,
    )


def unit_status(
    conn: psycopg.Connection,
    schema: str,
    table: str,
    unit: int = 0,
    lane: int = 0,
    lanes: int = 1,
    *,
    exact_up_to: int = BACKLOG_EXACT,
    dead_exact_up_to: int = DEAD_EXACT,
) -> UnitStatus:
    """One unit's rows: the table's, or with lanes > 1 those of its lane (by the mark query's hash),
    each figure read from at most `exact_up_to` + 1 rows (dead rows: `dead_exact_up_to` + 1), or by
    index, in one statement."""
    statement, params = unit_status_statement(
        schema, table, lane, lanes, exact_up_to=exact_up_to, dead_exact_up_to=dead_exact_up_to
    )
    try:
        row = one_row(conn.execute(statement, params))
    except psycopg.errors.UndefinedTable:
        conn.rollback()
        require_tables(conn, schema, table, f"{table}_dead")  # says which one, as an AdminError
        raise
    return unit_status_of(
        row, schema, table, unit, lane, lanes, exact_up_to=exact_up_to, dead_exact_up_to=dead_exact_up_to
    )


def _units_status(cfg: Config, conn: psycopg.Connection) -> list[UnitStatus]:
    """Every unit of the configuration; one whose database cannot be read says so (`error`)."""
    out: list[UnitStatus] = []
    others: dict[str, psycopg.Connection] = {}
    try:
        for spec in units(cfg):
            try:
                if spec.dsn == cfg.database.dsn:
                    c = conn
                elif spec.dsn in others:
                    c = others[spec.dsn]
                else:
                    c = others[spec.dsn] = psycopg.connect(spec.dsn, connect_timeout=10)
                u = unit_status(c, spec.schema, spec.table, spec.index, spec.lane, spec.lanes)
                c.rollback()  # read only: end the snapshot
            except (psycopg.Error, AdminError) as exc:
                db = cfg.database
                if (spec.dsn, spec.schema, spec.table) == (db.dsn, db.schema, db.outbox_table):
                    raise  # the `database` section's own outbox: the command's error, as ever
                u = UnitStatus(
                    unit=spec.index,
                    table=f"{spec.schema}.{spec.table}",
                    backlog_rows=0,
                    backlog_exact=False,
                    oldest_age_seconds=0.0,
                    in_flight_rows=0,
                    marked_by={},
                    dead_rows=0,
                    lane=spec.lane,
                    lanes=spec.lanes,
                    error=redact_dsn(logs_safe(exc)),
                )
                if spec.dsn == cfg.database.dsn:
                    conn.rollback()
            u.name, u.dead_command = spec.name, dead_mod.list_command(cfg, spec.outbox)
            out.append(u)
    finally:
        for c in others.values():
            c.close()
    return out


# Answers of a group coordinator that is moving or still loading (the first use of a fresh
# cluster's __consumer_offsets, a broker restart): asked again a moment later, it answers.
COORDINATOR_NOT_READY = frozenset(
    {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE}
)


def leaders(cfg: Config, timeout: float) -> tuple[dict[int, dict[str, Any]], str]:
    """Partition -> the leader-group member assigned it, and the group's state (Kafka's view).
    A coordinator that is not ready is asked again until `timeout` has passed."""
    h = cfg.harvester
    conf = {"bootstrap.servers": cfg.kafka.bootstrap_servers, **cfg.kafka.client, "logger": logs.KafkaLogger("admin")}
    admin = AdminClient(conf)
    deadline = time.monotonic() + timeout
    try:
        while True:
            future = admin.describe_consumer_groups([h.leader_group], request_timeout=timeout)[h.leader_group]
            try:
                desc = future.result(timeout=timeout + 5)
                break
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if not isinstance(err, KafkaError) or err.code() not in COORDINATOR_NOT_READY:
                    raise
                if time.monotonic() + 0.25 >= deadline:
                    raise
                time.sleep(0.25)
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
    all_units = _units_status(cfg, conn)
    require_tables(conn, db.schema, "batch")
    census = batch_census(conn, db.schema)
    conn.rollback()  # read only: end the snapshot
    status = OutboxStatus(
        units=all_units,
        batches=census.counts,
        items_pending=census.items_pending,
        batches_estimated=sorted(census.estimated),
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
        lane = f" lane {u.lane} of {u.lanes}" if u.lanes > 1 else ""
        lines.append(f"unit {u.unit} ({u.name}): {u.table}{lane}")
        if u.error is not None:
            lines.append(f"  unreadable      {u.error}")
            continue
        lines += [
            f"  backlog         {u.backlog_rows} rows{approx}",
            _oldest_line(u),
            f"  in flight       {u.in_flight_rows} rows",
        ]
        for leader_id, n in u.marked_by.items():
            lines.append(f"    marked by     {leader_id}: {n}")
        more = "more than " if u.dead_rows_capped else ""
        lines.append(f"  dead            {more}{u.dead_rows} rows ({u.dead_command})")
        if status.kafka_error:
            lines.append(f"  leader          unknown: {status.kafka_error}")
        elif u.leader is None:
            lines.append(f"  leader          none (group {status.leader_group!r} is {status.group_state})")
        else:
            ld = u.leader
            lines.append(f"  leader          {ld['host']} client {ld['client_id']!r} member {ld['member_id']}")
    b = {s: f"about {n}" if s in status.batches_estimated else str(n) for s, n in status.batches.items()}
    lines.append(
        f"batches: {b['open']} open, {b['closed']} closed, {b['complete']} complete, {b['expired']} expired; "
        f"{status.items_pending} items pending"
    )
    return "\n".join(lines)


def _oldest_line(u: UnitStatus) -> str:
    if not u.backlog_rows or u.oldest_id is None:
        return "  oldest row      -"
    marked = f"marked by {u.oldest_marked_by}" if u.oldest_marked_by else "not marked"
    return (
        f"  oldest row      {duration(u.oldest_age_seconds)} old: id {u.oldest_id}, topic {u.oldest_topic!r}, {marked}"
    )


def exit_code(status: OutboxStatus) -> ExitCode:
    unreadable = any(u.error is not None for u in status.units)
    return ExitCode.UNAVAILABLE if status.kafka_error or unreadable else ExitCode.OK


__all__ = ["OutboxStatus", "UnitStatus", "outbox_status", "render", "exit_code", "AdminError"]
