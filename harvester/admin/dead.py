"""`reaper dead list` and `reaper dead requeue`: rows Kafka refused for good (`<outbox>_dead`).

A requeue moves a row back in one statement (DELETE from the dead table ... INSERT into the
outbox), so a row is always in exactly one of the two tables, and a row two requeues race for is
moved by one of them: the other finds it gone (`--id`: waits for the lock, then fails naming it;
`--all`/`--reason`: leaves it to the other). The row gets a new outbox id and `created_at` (it is
committed now, so it goes behind rows already waiting) and keeps its topic, key, value, headers and
partition. If Kafka still refuses it, the leader quarantines it again under its new id.

`--id` moves the named rows in one transaction, or none of them. `--all` and `--reason` move the
rows that were dead when the command started, in chunks of `--chunk` rows, each chunk its own
transaction (locks stay short and a progress bar can move); a requeue interrupted midway leaves
the rest dead, and running it again goes on. Every committed chunk is recorded in `admin_log`.
Their chunks first pass over rows another transaction holds, so racing requeues share the work;
then they go over what is still dead once more, waiting for each lock, since a holder may be one
that moves nothing (a dry run, an `--id` that fails, a `SELECT ... FOR UPDATE` by hand): no row
dead at the start is left dead by a requeue that reports success. They report how many rows moved
and the ids of the first ID_SAMPLE only, so a requeue of millions holds no list of them all.

Both read the `database` section's outbox table, or with `--outbox NAME` that harvester.outboxes
entry's (`target`): its database, schema and table, and the `admin_log` of its schema.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from harvester.admin.common import AdminError, one_row, require_tables, text_or_hex, when
from harvester.config import Config, units
from harvester.exit_codes import ExitCode
from tracker.schema import qualified


@dataclass
class DeadRow:
    id: int
    failed_at: dt.datetime
    created_at: dt.datetime
    topic: str
    partition: int | None
    key: dict[str, str | None]
    value_bytes: int | None
    headers: list[str]
    reason: str
    leader_id: str | None


@dataclass
class DeadPage:
    rows: list[DeadRow]
    matching: int  # dead rows matching the filter, all pages
    next_after: int | None  # pass as --after for the next page; None: last page


@dataclass(frozen=True)
class Target:
    """The outbox table whose dead rows a command reads: where it is."""

    dsn: str
    schema: str
    table: str


def target(cfg: Config, outbox: str | None) -> Target:
    """The `database` section's outbox table (`outbox` None), or the one of the harvester.outboxes
    entry named `outbox` (without entries, the one outbox is named "default"); another name is a
    usage error naming it and the names there are."""
    db = cfg.database
    if outbox is None:
        return Target(db.dsn, db.schema, db.outbox_table)
    specs = units(cfg)
    for spec in specs:
        if spec.outbox == outbox:
            return Target(spec.dsn, spec.schema, spec.table)
    known = list(dict.fromkeys(s.outbox for s in specs))
    listed = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
    raise AdminError(
        f"--outbox {outbox!r} is not an outbox of the configuration (its outboxes: {listed})", ExitCode.USAGE
    )


def list_command(cfg: Config, outbox: str) -> str:
    """The `reaper dead list` command line for the dead rows of the outbox named `outbox` (a unit's
    `UnitSpec.outbox`): plain without harvester.outboxes, else with `--outbox`."""
    if not cfg.harvester.outboxes:
        return "reaper dead list"
    # (a name may start with "-", which argparse takes for an option unless joined to it by "=")
    return f"reaper dead list --outbox{'=' if outbox.startswith('-') else ' '}{outbox}"


ID_SAMPLE = 1000  # ids of moved rows that `--all`/`--reason` report at most (the first ones moved)


@dataclass
class Requeued:
    moved: int = 0
    # The rows' ids in the dead table (their old outbox ids) and their new outbox ids, in the order
    # moved: all of them for --id, the first ID_SAMPLE for --all/--reason (ids_complete says which).
    dead_ids: list[int] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    dry_run: bool = False
    ids_complete: bool = True  # dead_ids and new_ids name every row moved

    def add(self, dead_ids: Sequence[int], new_ids: Sequence[int]) -> None:
        """Count a committed chunk; keep its ids while the sample has room."""
        self.moved += len(dead_ids)
        room = ID_SAMPLE - len(self.dead_ids)
        self.dead_ids += dead_ids[:room]
        self.new_ids += new_ids[:room]
        self.ids_complete = self.ids_complete and len(dead_ids) <= room


@functools.lru_cache(maxsize=32)
def _statements(schema: str, table: str) -> dict[str, sql.Composed]:
    names = {
        "outbox": qualified(schema, table),
        "dead": qualified(schema, f"{table}_dead"),
        "log": qualified(schema, "admin_log"),
    }
    match = sql.SQL("(%(reason)s::text IS NULL OR strpos(reason, %(reason)s::text) > 0)")
    move = (
        "moved AS (DELETE FROM {dead} d USING pick WHERE d.id = pick.id "
        "RETURNING d.id, d.topic, d.key, d.value, d.header_keys, d.header_values, d.kafka_partition), "
        "ins AS (INSERT INTO {outbox} (topic, key, value, header_keys, header_values, kafka_partition) "
        "SELECT topic, key, value, header_keys, header_values, kafka_partition FROM moved ORDER BY id RETURNING id), "
        "log AS (INSERT INTO {log} (action, rows, detail) SELECT 'dead-requeue', count(*), "
        "jsonb_build_object('dead_ids', jsonb_agg(id ORDER BY id), 'filter', %(filter)s::jsonb) FROM moved "
        "HAVING count(*) > 0) "
        "SELECT (SELECT coalesce(array_agg(id ORDER BY id), '{{}}') FROM moved), "
        "(SELECT coalesce(array_agg(id ORDER BY id), '{{}}') FROM ins)"
    )
    q = {
        "page": sql.SQL(
            "SELECT id, failed_at, created_at, topic, kafka_partition, key, length(value), header_keys, reason, "
            "leader_id::text FROM {dead} WHERE id > %(after)s AND {match} ORDER BY id LIMIT %(limit)s"
        ),
        "count": sql.SQL("SELECT count(*), max(id) FROM {dead} WHERE {match}"),
        "count_capped": sql.SQL("SELECT count(*), NULL FROM (SELECT 1 FROM {dead} WHERE {match} LIMIT %(cap)s) s"),
        "find_ids": sql.SQL("SELECT id FROM {dead} WHERE id = ANY(%(ids)s::bigint[])"),
        # In id order, as the chunks below lock: two lockers never wait for each other in a cycle.
        "lock_ids": sql.SQL("SELECT id FROM {dead} WHERE id = ANY(%(ids)s::bigint[]) ORDER BY id FOR UPDATE"),
        "move_ids": sql.SQL("WITH pick AS (SELECT unnest(%(ids)s::bigint[]) AS id), " + move),
        # SKIP LOCKED: rows a racing requeue holds are likely its to move; what is left unlocked is ours.
        "move_chunk": sql.SQL(
            "WITH pick AS (SELECT id FROM {dead} WHERE id > %(after)s AND id <= %(upto)s AND {match} "
            "ORDER BY id LIMIT %(chunk)s FOR UPDATE SKIP LOCKED), " + move
        ),
        # Waits for each lock; a row its holder moved meanwhile drops out, and the scan goes on.
        "move_chunk_waiting": sql.SQL(
            "WITH pick AS (SELECT id FROM {dead} WHERE id > %(after)s AND id <= %(upto)s AND {match} "
            "ORDER BY id LIMIT %(chunk)s FOR UPDATE), " + move
        ),
    }
    return {k: v.format(match=match, **names) for k, v in q.items()}


def list_dead(
    conn: psycopg.Connection,
    schema: str,
    table: str,
    *,
    reason: str | None = None,
    after: int = 0,
    limit: int = 50,
    count_cap: int | None = None,
) -> DeadPage:
    """A page of dead rows by id; `matching` counts them all, or up to `count_cap` + 1 when given
    (the console: a dead table of millions is not read whole at every page view)."""
    require_tables(conn, schema, f"{table}_dead")
    q = _statements(schema, table)
    rows = conn.execute(q["page"], {"after": after, "reason": reason, "limit": limit + 1}).fetchall()
    if count_cap is None:
        matching = one_row(conn.execute(q["count"], {"reason": reason}))[0]
    else:
        matching = one_row(conn.execute(q["count_capped"], {"reason": reason, "cap": count_cap + 1}))[0]
    conn.rollback()
    page = [
        DeadRow(
            id=r[0],
            failed_at=r[1],
            created_at=r[2],
            topic=r[3],
            partition=r[4],
            key=text_or_hex(r[5]),
            value_bytes=r[6],
            headers=list(r[7]),
            reason=r[8],
            leader_id=r[9],
        )
        for r in rows[:limit]
    ]
    return DeadPage(page, matching, page[-1].id if len(rows) > limit else None)


def requeue_ids(
    conn: psycopg.Connection, schema: str, table: str, ids: Sequence[int], *, dry_run: bool = False
) -> Requeued:
    """Move exactly these dead rows back, in one transaction; if any is not dead, move none."""
    require_tables(conn, schema, table, f"{table}_dead", "admin_log")
    q = _statements(schema, table)
    wanted = sorted(set(ids))
    # A dry run locks nothing: a lock it held and let go would only make others wait or skip rows.
    found = {r[0] for r in conn.execute(q["find_ids" if dry_run else "lock_ids"], {"ids": wanted}).fetchall()}
    missing = [i for i in wanted if i not in found]
    if missing:
        conn.rollback()
        shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
        raise AdminError(
            f"not in {schema}.{table}_dead (never quarantined, or already requeued): {shown}; nothing was requeued",
            ExitCode.NOT_FOUND,
        )
    if dry_run:
        conn.rollback()
        return Requeued(len(wanted), wanted, [], dry_run=True)
    dead_ids, new_ids = one_row(conn.execute(q["move_ids"], {"ids": wanted, "filter": json.dumps({"ids": wanted})}))
    conn.commit()
    return Requeued(len(dead_ids), list(dead_ids), list(new_ids))


def requeue_matching(
    conn: psycopg.Connection,
    schema: str,
    table: str,
    *,
    reason: str | None = None,
    chunk: int = 1000,
    dry_run: bool = False,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> Requeued:
    """Move every row dead now (whose reason contains `reason`, if given), `chunk` rows per transaction.

    `progress(moved so far, total)` is called after each chunk. The result counts every row moved
    and names the first ID_SAMPLE (`ids_complete` is False when there were more).
    """
    require_tables(conn, schema, table, f"{table}_dead", "admin_log")
    q = _statements(schema, table)
    total, upto = one_row(conn.execute(q["count"], {"reason": reason}))
    conn.rollback()
    result = Requeued(dry_run=dry_run)
    if dry_run or not total:
        result.moved = total if dry_run else 0
        result.ids_complete = not result.moved  # a dry run of these names no ids
        return result
    progress(0, total)
    params: dict[str, Any] = {
        "upto": upto,
        "reason": reason,
        "chunk": chunk,
        "filter": json.dumps({"all": reason is None, "reason": reason}),
    }
    # First pass: rows another transaction holds are passed over (a racing requeue's chunk is its
    # to move), so several requeues share the rows. Second pass: what is still dead, waiting for
    # each lock, since the holder may have moved nothing (a dry run, an --id that failed).
    for statement in (q["move_chunk"], q["move_chunk_waiting"]):
        params["after"] = 0
        while True:
            dead_ids, new_ids = one_row(conn.execute(statement, params))
            conn.commit()
            result.add(dead_ids, new_ids)
            progress(result.moved, max(total, result.moved))
            if len(dead_ids) < chunk:
                break
            params["after"] = dead_ids[-1]
    return result


def render_page(page: DeadPage) -> str:
    if not page.rows:
        return f"no dead rows ({page.matching} match)"
    lines = [f"{'id':>10}  {'failed at':<23}  {'topic':<24} {'part':>4}  {'bytes':>7}  key / reason"]
    for r in page.rows:
        key = r.key.get("text") if "text" in r.key else "0x" + (r.key.get("hex") or "")
        part = "-" if r.partition is None else str(r.partition)
        size = "null" if r.value_bytes is None else str(r.value_bytes)
        lines.append(f"{r.id:>10}  {when(r.failed_at):<23}  {r.topic[:24]:<24} {part:>4}  {size:>7}  {key!r}")
        lines.append(f"{'':>10}  {r.reason}")
    lines.append(
        f"{len(page.rows)} shown of {page.matching} matching"
        + (f"; next page: --after {page.next_after}" if page.next_after is not None else "")
    )
    return "\n".join(lines)


def render_requeued(r: Requeued) -> str:
    if r.dry_run:
        return f"would requeue {r.moved} rows (dry run: nothing changed)"
    if not r.moved:
        return "requeued 0 rows: nothing matched"
    ids = ", ".join(map(str, r.dead_ids[:10])) + (" ..." if r.moved > 10 else "")
    if not r.ids_complete:
        return f"requeued {r.moved} rows (dead ids {ids}) as outbox ids {r.new_ids[0]}, ..."
    return f"requeued {r.moved} rows (dead ids {ids}) as outbox ids {r.new_ids[0]}..{r.new_ids[-1]}"
