"""Acks: fold item ids into one mask per group; two ways to apply them.

`ack()` / `claim_masks()` (consumers, in the caller's transaction; issue 12): no batch or group row
is locked or updated. One claim row per item is inserted into `ack_claim`, whose primary key is
the per-item exclusion: a concurrent claim of the same item waits on the unique index until the
first transaction ends, then finds its committed claim (a duplicate) or, once settled, the cleared
bit. The bit is then read by a fresh statement (READ COMMITTED: it sees what the wait waited for;
REPEATABLE READ / SERIALIZABLE: read with FOR SHARE, so a group row changed since the snapshot
raises a serialization failure instead of handing a stale "still pending" to exactly_once; the
lock is taken in a savepoint rolled back at once, so it never holds a settle up). An
item counts as acked by this call if its claim is new and its bit still set. Bits, pending counts
and the completion decision are folded at commit by `ack_settle` (sql/0006_ack_claims.sql) under
the batch row lock, or later by the next settle of the batch (tracker.settler) if that lock was
busy at commit. So acks of one batch, and their effects, commit in parallel; `completed` is
always empty here (completion happens at or after commit).

`apply_masks()` (the reaper's acker, Spark: their own short transactions): lock the named batches
(FOR NO KEY UPDATE, in batch-id order, so concurrent acks and closes never deadlock; optionally
SKIP LOCKED, returning what it skipped), read the named groups' sizes, validate, then one
statement that clears the masked bits of every group, lowers each group's and each batch's
pending by the number of bits that actually flipped (`bit_count(bits & mask)`), completes the
batches that became `closed and pending = 0` and writes their completion events. Duplicates flip
nothing, so they never double count; a re-ack after completion reports only duplicates.

Both paths count flips against the bits as they are under the batch row lock, so they agree on
counts and on the one completion whichever of them clears a bit first.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import psycopg
from psycopg import sql

from . import metrics
from .batches import completion_insert
from .errors import BatchExpired, IndexOutOfRange, UnknownBatch, UnknownGroup
from .ids import GroupMask, fold, format_run
from .session import DEFAULTS, atomic_pipeline, pg_connection, schema_of


@dataclass
class AckResult:
    acked: int = 0           # bits this call cleared
    duplicates: int = 0      # ids whose bit was already clear (or named twice in the call)
    completed: list[int] = field(default_factory=list)  # batches this call completed
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item id or run, reason), reject_invalid only
    # apply_masks(skip_locked=True): masks of batches another transaction held locked, not applied
    skipped: dict[tuple[int, int], GroupMask] = field(default_factory=dict)


@functools.lru_cache(maxsize=64)
def _statements(schema: str, outbox_table: str) -> dict[str, str]:
    t = {"batch": sql.Identifier(schema, "batch"), "group": sql.Identifier(schema, "batch_group"),
         "claim": sql.Identifier(schema, "ack_claim"), "request": sql.Identifier(schema, "ack_settle_request")}
    q = {
        "lock": sql.SQL("SELECT id, state FROM {batch} WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE"),
        "lock_skip": sql.SQL("SELECT id, state FROM {batch} WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE SKIP LOCKED"),
        "states": sql.SQL("SELECT id, state FROM {batch} WHERE id = ANY(%s)"),
        # Claims in (batch, group, index) order, so two calls claiming overlapping items cannot
        # deadlock each other; a commit-time settle is queued for every batch claimed in.
        "claim": sql.SQL(
            "WITH c AS (INSERT INTO {claim} (batch_id, group_id, idx)"
            " SELECT * FROM unnest(%s::int8[], %s::int8[], %s::int4[]) ORDER BY 1, 2, 3"
            " ON CONFLICT DO NOTHING RETURNING batch_id, group_id, idx),"
            " r AS (INSERT INTO {request} (batch_id, outbox, topic)"
            " SELECT DISTINCT batch_id, %s::regclass, %s FROM c ON CONFLICT DO NOTHING)"
            " SELECT batch_id, group_id, idx FROM c"),
        # Must be statements after "claim": their snapshot is taken after its waits.
        "read": sql.SQL(
            "SELECT u.b, u.g, u.i, CASE WHEN u.i < g.size THEN get_bit(g.bits, u.i) END"
            " FROM unnest(%s::int8[], %s::int8[], %s::int4[]) AS u(b, g, i)"
            " JOIN {group} g ON g.batch_id = u.b AND g.id = u.g"),
        "read_locked": sql.SQL(
            "SELECT u.b, u.g, u.i, CASE WHEN u.i < g.size THEN get_bit(g.bits, u.i) END"
            " FROM unnest(%s::int8[], %s::int8[], %s::int4[]) AS u(b, g, i)"
            " JOIN {group} g ON g.batch_id = u.b AND g.id = u.g"
            " WHERE current_setting('transaction_isolation') <> 'read committed' FOR SHARE OF g SKIP LOCKED"),
        "isolation": sql.SQL("SELECT current_setting('transaction_isolation')"),
        "sizes": sql.SQL(
            "SELECT g.batch_id, g.id, g.size FROM unnest(%s::int8[], %s::int8[]) AS u(batch_id, id) "
            "JOIN {group} g ON g.batch_id = u.batch_id AND g.id = u.id"),
        "apply": sql.SQL(
            "WITH m AS MATERIALIZED ("
            " SELECT g.batch_id, g.id, mk.mask, bit_count(g.bits & mk.mask) AS flipped"
            " FROM unnest(%s::int8[], %s::int8[], %s::text[]) AS u(batch_id, id, hex)"
            " JOIN {group} g ON g.batch_id = u.batch_id AND g.id = u.id"
            " CROSS JOIN LATERAL (SELECT substring(('x' || u.hex)::varbit FROM 1 FOR g.size) AS mask) mk),"
            " cleared AS (UPDATE {group} g SET bits = g.bits & ~m.mask, pending = g.pending - m.flipped"
            " FROM m WHERE g.batch_id = m.batch_id AND g.id = m.id AND m.flipped > 0),"
            " d AS (SELECT batch_id, sum(flipped)::int8 AS flipped FROM m GROUP BY batch_id),"
            " b AS (UPDATE {batch} b SET pending = b.pending - d.flipped, last_activity_at = clock_timestamp(),"
            " state = CASE WHEN b.state = 'closed' AND b.pending = d.flipped THEN 'complete' ELSE b.state END,"
            " completed_at = CASE WHEN b.state = 'closed' AND b.pending = d.flipped THEN clock_timestamp()"
            " ELSE b.completed_at END"
            " FROM d WHERE b.id = d.batch_id"
            " RETURNING b.id, b.state, d.flipped, b.user_key, b.total, b.created_at, b.closed_at, b.completed_at,"
            " b.completion_topic),"
            # A batch completed here: new state complete and bits flipped (a batch that was
            # already complete has no set bit left to flip).
            " finished AS (SELECT * FROM b WHERE state = 'complete' AND flipped > 0),"
            " event AS ({insert})"
            " SELECT id, flipped, state = 'complete' AND flipped > 0 FROM b"),
    }
    insert = completion_insert(schema, outbox_table)
    return {k: v.format(insert=insert, **t).as_string(None) for k, v in q.items()}


def _first_index(mask: GroupMask, lo: int = 0) -> int:
    return next(mask.indexes(lo), lo)


def _runs(mask: GroupMask, lo: int = 0) -> list[str]:
    """The set bits at or above `lo`, as ids and runs (for rejects)."""
    out: list[str] = []
    start = prev = None
    for i in mask.indexes(lo):
        if start is not None and i != prev + 1:
            out.append(format_run(mask.batch_id, mask.group_id, start, prev))
            start = None
        if start is None:
            start = i
        prev = i
    if start is not None:
        out.append(format_run(mask.batch_id, mask.group_id, start, prev))
    return out


def _set_bits_from(mask: GroupMask, lo: int) -> int:
    total = 0
    first_byte = lo >> 3
    if lo & 7 and first_byte < len(mask.bits):
        total += bin(mask.bits[first_byte] & (0xFF >> (lo & 7))).count("1")
        first_byte += 1
    return total + int.from_bytes(mask.bits[first_byte:], "big").bit_count()


def _check(todo: list[GroupMask], states: dict[int, str], sizes: dict[tuple[int, int], int], reject_invalid: bool,
           result: AckResult) -> tuple[list[tuple[GroupMask, int]], int]:
    """The masks that may be applied, each with its group's size, and how many ids they count.
    Raises the first problem's typed error, or (reject_invalid) records it in result.rejected."""
    live: list[tuple[GroupMask, int]] = []
    counted = 0
    for m in todo:
        state = states.get(m.batch_id)
        if state is None or state == "expired":
            first = m.item_id(_first_index(m))
            if not reject_invalid:
                raise UnknownBatch(m.batch_id, first) if state is None else BatchExpired(m.batch_id, first)
            reason = "unknown batch" if state is None else "batch expired"
            result.rejected.extend((run, reason) for run in _runs(m))
            continue
        size = sizes.get((m.batch_id, m.group_id))
        if size is None:
            if not reject_invalid:
                raise UnknownGroup(m.batch_id, m.group_id, m.item_id(_first_index(m)))
            result.rejected.extend((run, "unknown group") for run in _runs(m))
            continue
        count = m.count
        if m.max_index >= size:
            if not reject_invalid:
                raise IndexOutOfRange(m.item_id(_first_index(m, size)), size)
            result.rejected.extend((run, f"index out of range (group size {size})") for run in _runs(m, size))
            count -= _set_bits_from(m, size)
        live.append((m, size))
        counted += count
    return live, counted


def _observe(result: AckResult, started: float) -> AckResult:
    metrics.acks_applied.inc(result.acked)
    metrics.acks_duplicate.inc(result.duplicates)
    metrics.batches_completed.inc(len(result.completed))
    metrics.ack_apply_duration.observe(time.perf_counter() - started)
    return result


def apply_masks(conn: psycopg.Connection, masks: Mapping[tuple[int, int], GroupMask], *, schema: str | None = None,
                reject_invalid: bool = False, skip_locked: bool = False) -> AckResult:
    """Apply folded masks (from `tracker.ids.fold`) in the caller's transaction, directly: the
    named batch rows stay locked until the caller commits. For short transactions of their own
    (the acker, Spark); consumers use `ack()`, which never holds a batch lock.

    reject_invalid=False: the first unknown batch/group, out-of-range index or expired batch raises
    its typed error and nothing is applied. reject_invalid=True: those entries are left out and
    returned in `rejected` as (item id or run, reason); the valid rest is applied.
    skip_locked=True: batches another transaction holds locked are not waited for; their masks
    come back in `skipped`, to be applied later.
    """
    started = time.perf_counter()
    q = _statements(schema_of(schema), DEFAULTS.outbox_table)
    result = AckResult()
    todo = [m for m in masks.values() if m.count]
    if not todo:
        return result
    batch_ids = sorted({m.batch_id for m in todo})
    with atomic_pipeline(conn):
        # One round trip: savepoint, batch locks (in id order), then the groups' sizes, read after
        # the locks are held so that an add committed while we waited is seen.
        lock_cursor = conn.execute(q["lock_skip" if skip_locked else "lock"], [batch_ids])
        states_cursor = conn.execute(q["states"], [batch_ids]) if skip_locked else None
        sizes_cursor = conn.execute(q["sizes"], [[m.batch_id for m in todo], [m.group_id for m in todo]])
        states = dict(lock_cursor.fetchall())
        if states_cursor is not None:
            held = {b for b, _state in states_cursor.fetchall()} - states.keys()
            result.skipped = {(m.batch_id, m.group_id): m for m in todo if m.batch_id in held}
            todo = [m for m in todo if m.batch_id not in held]
        sizes = {(b, g): size for b, g, size in sizes_cursor.fetchall()}
        live, counted = _check(todo, states, sizes, reject_invalid, result)
        batch_col, group_col, hexes = [], [], []
        for m, size in live:
            nbytes = (size + 7) >> 3
            bits = m.bits
            if len(bits) != nbytes:
                bits = bits[:nbytes] if len(bits) > nbytes else bits + bytes(nbytes - len(bits))
            batch_col.append(m.batch_id)
            group_col.append(m.group_id)
            hexes.append(bits.hex())
        applied = conn.execute(q["apply"], [batch_col, group_col, hexes, DEFAULTS.completion_topic]) if live else None
    # (the pipeline has synced: the savepoint is released, the rows are here)
    for batch_id, flipped, completed in applied.fetchall() if applied is not None else ():
        result.acked += flipped
        if completed:
            result.completed.append(batch_id)
    result.duplicates = max(0, counted - result.acked)
    return _observe(result, started)


def claim_masks(conn: psycopg.Connection, masks: Mapping[tuple[int, int], GroupMask], *,
                schema: str | None = None) -> AckResult:
    """Ack folded masks in the caller's transaction by claiming their items (see the module doc):
    no batch-wide lock; counts, bits and completion are settled at commit (or by the next settle).

    Raises UnknownBatch, UnknownGroup, IndexOutOfRange or BatchExpired naming the first offending
    id; then nothing of the call was applied. `acked`: items whose claim is new in this
    transaction and whose bit was still set; the rest are `duplicates`.
    """
    started = time.perf_counter()
    schema = schema_of(schema)
    q = _statements(schema, DEFAULTS.outbox_table)
    result = AckResult()
    todo = [m for m in masks.values() if m.count]
    if not todo:
        return result
    b_col: list[int] = []
    g_col: list[int] = []
    i_col: list[int] = []
    for m in todo:
        for i in m.indexes():
            b_col.append(m.batch_id)
            g_col.append(m.group_id)
            i_col.append(i)
    columns = [b_col, g_col, i_col]
    outbox = sql.Identifier(schema, DEFAULTS.outbox_table).as_string(None)
    with atomic_pipeline(conn):
        # One round trip. An invalid id is found only when the rows are back: the claims made by
        # then are undone with the savepoint.
        states_cursor = conn.execute(q["states"], [sorted({m.batch_id for m in todo})])
        sizes_cursor = conn.execute(q["sizes"], [[m.batch_id for m in todo], [m.group_id for m in todo]])
        claim_cursor = conn.execute(q["claim"], [*columns, outbox, DEFAULTS.completion_topic])
        read_cursor = conn.execute(q["read"], columns)
        # REPEATABLE READ / SERIALIZABLE only: the snapshot may predate the settle that cleared a
        # bit. FOR SHARE raises a serialization error if the group row changed since the snapshot;
        # SKIP LOCKED: never wait (a settle may be updating the row and waiting for a lock this
        # transaction holds); the savepoint drops the locks at once, so no settle waits for them.
        conn.execute("SAVEPOINT tracker_fresh")
        locked_cursor = conn.execute(q["read_locked"], columns)
        conn.execute("ROLLBACK TO SAVEPOINT tracker_fresh")
        isolation_cursor = conn.execute(q["isolation"])
        states = dict(states_cursor.fetchall())
        sizes = {(b, g): size for b, g, size in sizes_cursor.fetchall()}
        _live, counted = _check(todo, states, sizes, False, result)
        claimed = set(claim_cursor.fetchall())
        fresh = [(b, g, i) for b, g, i, bit in read_cursor.fetchall() if bit == 1 and (b, g, i) in claimed]
        checked = {(b, g) for b, g, _i, _bit in locked_cursor.fetchall()}
        if isolation_cursor.fetchone()[0] != "read committed":
            busy = sorted({(b, g) for b, g, _i in fresh} - checked)
            if busy:  # being updated right now: whether the snapshot's bit is still set is unknown
                raise psycopg.errors.SerializationFailure(
                    f"could not serialize ack: group {busy[0][0]}:{busy[0][1]} is being updated concurrently; "
                    "retry the transaction")
    result.acked = len(fresh)
    result.duplicates = max(0, counted - result.acked)
    return _observe(result, started)


def ack(session: Any, item_ids: Iterable[str | bytes], *, schema: str | None = None) -> AckResult:
    """Ack item ids (and runs '<b>:<g>:<start>-<end>') in the caller's transaction, by claims
    (`claim_masks`): bits and counts change when the caller commits, completion at or after it.

    Raises MalformedItemId, UnknownBatch, UnknownGroup, IndexOutOfRange or BatchExpired naming the
    offending id; then nothing of the call was applied.
    """
    if isinstance(item_ids, (str, bytes)):
        item_ids = [item_ids]
    masks = fold(item_ids)
    return claim_masks(pg_connection(session), masks, schema=schema)
