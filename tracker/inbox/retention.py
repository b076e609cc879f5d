"""The inbox's retention: partitions made ahead of time and expired ones dropped whole, plus what
operators read (partitions, where an id is recorded).

Why partitions: an id must be kept for the retention window and then go, at the rate ids arrive,
without hurting the claims running meanwhile. A DELETE of expired ids writes WAL and dead tuples
for every id, and its length grows with the backlog; dropping a partition costs the same whatever
it holds. `maintain` detaches an expired partition CONCURRENTLY (SHARE UPDATE EXCLUSIVE on the
inbox: no claim ever waits for it), then drops the detached table, which nobody can see any more.
Making a partition attaches an empty table (SHARE UPDATE EXCLUSIVE again). Every DDL statement
runs under a short lock_timeout: one that cannot get its lock is left for the next run.

Ids are kept at least `retention` and at most `retention + bucket` after they were received; a
message redelivered after that runs again.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import psycopg
from psycopg import sql

from tracker.config import DEFAULT_SCHEMA
from tracker.errors import InvalidArgument, InvalidValue
from tracker.inbox.core import check_text
from tracker.schema import check_identifier

DAY = 86400.0
MAX_PARTITIONS = 1000  # made ahead, or held over the retention window: bounds what one run may create


@dataclass(frozen=True)
class Retention:
    """How long ids are kept (`retention`, seconds), the span of one partition (`bucket`, seconds,
    1 minute to 31 days), how far ahead partitions are made (`ahead`, seconds), and at most how many
    expired partitions one run drops (`max_drops`). Refused (InvalidValue naming the value) unless
    the window and the time ahead each hold at most 1000 partitions. Run `maintain` at least every
    `ahead / 2`: its partitions reach just past `ahead` from when it ran, so a run further apart (or
    one skipped, a busy lock) leaves the current time without a partition, and claims fail."""

    retention: float = 7 * DAY
    bucket: float = DAY
    ahead: float = 3 * DAY
    max_drops: int = 10
    lock_timeout: float = 0.5

    def __post_init__(self) -> None:
        for name, low, high in [
            ("bucket", 60.0, 31 * DAY),
            ("retention", 60.0, 3660 * DAY),
            ("ahead", 0.0, 366 * DAY),
            ("lock_timeout", 0.001, 60.0),
        ]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidArgument(name, value, "a number of seconds")
            if not low <= value <= high:
                raise InvalidValue(name, value, f"must be between {low:g} and {high:g} seconds")
        for name in ("retention", "ahead"):
            if getattr(self, name) / self.bucket > MAX_PARTITIONS:
                raise InvalidValue(name, getattr(self, name), f"would span more than {MAX_PARTITIONS} partitions")
        if isinstance(self.max_drops, bool) or not isinstance(self.max_drops, int):
            raise InvalidArgument("max_drops", self.max_drops, "an int")
        if not 1 <= self.max_drops <= MAX_PARTITIONS:
            raise InvalidValue("max_drops", self.max_drops, f"must be between 1 and {MAX_PARTITIONS}")


@dataclass
class MaintenanceResult:
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # expired, but their lock was busy: next run
    ids_dropped: int = 0  # ids in the dropped partitions (counted from the statistics, an estimate)
    drop_seconds: float = 0.0  # time spent detaching and dropping


@dataclass(frozen=True)
class Partition:
    name: str
    lower: datetime.datetime
    upper: datetime.datetime
    attached: bool
    rows_estimate: int
    bytes: int
    holds_ids: bool


@dataclass(frozen=True)
class Recorded:
    consumer: str
    received_at: datetime.datetime
    partition: str


def _q(schema: str, text: str, **tables: str) -> sql.Composed:
    names = {k: sql.Identifier(check_identifier(schema, "schema"), v) for k, v in tables.items()}
    return sql.SQL(text).format(**names)


def _autocommit(conn: psycopg.Connection) -> None:
    if not isinstance(conn, psycopg.Connection):
        raise InvalidArgument("conn", conn, "a psycopg Connection")
    if not conn.autocommit or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise InvalidValue(
            "conn", conn, "the inbox maintenance needs an idle autocommit connection: each step commits on its own"
        )


def maintain(
    conn: psycopg.Connection,
    *,
    schema: str = DEFAULT_SCHEMA,
    policy: Retention | None = None,
    concurrently: bool = True,
) -> MaintenanceResult:
    """Make the partitions `policy.ahead` needs and drop up to `policy.max_drops` expired ones, on an
    idle autocommit connection (an upkeep call, like `migrate`: each step is a short transaction of
    its own). Safe with several maintainers at once. Dropping detaches CONCURRENTLY, which needs the
    inbox's owner; a role that is not (the reaper role) drops through the SQL function
    inbox_drop_expired instead, whose DROP waits at most 100 ms for its lock (so does a claim
    queued behind it). `concurrently=False` takes that way always."""
    p = policy or Retention()
    _autocommit(conn)
    out = MaintenanceResult()
    timeout = f"{int(p.lock_timeout * 1000)}ms"
    with conn.transaction():
        conn.execute("SELECT set_config('lock_timeout', %s, true)", [timeout])
        rows = conn.execute(
            _q(
                schema,
                "SELECT * FROM {f}(make_interval(secs => %s), make_interval(secs => %s))",
                f="inbox_add_partitions",
            ),
            [p.bucket, p.ahead],
        ).fetchall()
        out.created = [r[0] for r in rows]
    expired = conn.execute(
        _q(
            schema,
            "SELECT p.name, c.oid IS NOT NULL, coalesce(h.inhdetachpending, false), h.inhrelid IS NOT NULL,"
            " greatest(coalesce(c.reltuples, 0), 0)::bigint"
            " FROM {part} p LEFT JOIN pg_class c ON c.relname = p.name AND c.relnamespace = %s::regnamespace"
            " LEFT JOIN pg_inherits h ON h.inhrelid = c.oid"
            " WHERE p.upper <= now() - make_interval(secs => %s) ORDER BY p.lower LIMIT %s",
            part="inbox_partition",
        ),
        [sql.Identifier(schema).as_string(conn), p.retention, p.max_drops],
    ).fetchall()
    started = time.perf_counter()
    owner = concurrently
    for name, exists, pending, attached, rows_estimate in expired:
        if not owner:
            break
        table = sql.Identifier(schema, name)
        try:
            if exists and (attached or pending):
                conn.execute("SELECT set_config('lock_timeout', %s, false)", [timeout])
                try:
                    how = "FINALIZE" if pending else "CONCURRENTLY"
                    detach = sql.SQL("ALTER TABLE {} DETACH PARTITION {} " + how)
                    conn.execute(detach.format(sql.Identifier(schema, "inbox"), table))
                except psycopg.errors.UndefinedTable:
                    pass  # "is not a partition": another maintainer detached it meanwhile; drop it
                finally:
                    conn.execute("RESET lock_timeout")
            with conn.transaction():
                conn.execute("SELECT set_config('lock_timeout', %s, true)", [timeout])
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
                gone = conn.execute(
                    _q(schema, "DELETE FROM {part} WHERE name = %s RETURNING 1", part="inbox_partition"), [name]
                ).fetchone()
            if gone is not None:  # else another maintainer dropped it meanwhile, and counts it
                out.dropped.append(name)
                out.ids_dropped += rows_estimate
        except psycopg.errors.InsufficientPrivilege:
            owner = False  # not the inbox's owner: the SQL function below, as its owner
        except (
            psycopg.errors.LockNotAvailable,
            psycopg.errors.QueryCanceled,
            psycopg.errors.ObjectInUse,
            psycopg.errors.ObjectNotInPrerequisiteState,
        ):
            out.skipped.append(name)
    if not owner or not concurrently:
        with conn.transaction():
            rows = conn.execute(
                _q(schema, "SELECT * FROM {f}(make_interval(secs => %s), %s)", f="inbox_drop_expired"),
                [p.retention, p.max_drops - len(out.dropped)],
            ).fetchall()
        out.dropped += [r[0] for r in rows]
        out.skipped = [n for n, *_ in expired if n not in out.dropped]
    out.drop_seconds = time.perf_counter() - started
    return out


def partitions(conn: psycopg.Connection, *, schema: str = DEFAULT_SCHEMA) -> list[Partition]:
    """The inbox's partitions, oldest first (read in the caller's transaction, writing nothing)."""
    rows = conn.execute(_q(schema, "SELECT * FROM {f}()", f="inbox_partitions")).fetchall()
    return [Partition(*r) for r in rows]


def show(
    conn: psycopg.Connection, message_id: str, *, consumer: str | None = None, schema: str = DEFAULT_SCHEMA
) -> list[Recorded]:
    """Where `message_id` is recorded: one entry per consumer that processed it within the window
    (only `consumer`'s when given). Reads through the (consumer, id) indexes, never a whole partition."""
    mid = check_text("message_id", message_id)
    who = None if consumer is None else check_text("consumer", consumer)
    rows = conn.execute(_q(schema, "SELECT * FROM {f}(%s, %s)", f="inbox_show"), [mid, who]).fetchall()
    return [Recorded(*r) for r in rows]


__all__ = ["MaintenanceResult", "Partition", "Recorded", "Retention", "maintain", "partitions", "show"]
