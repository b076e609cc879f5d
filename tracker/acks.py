"""Acks: fold item ids into one mask per group, apply the masks with set-based SQL.

One call = lock the named batches (FOR NO KEY UPDATE, in batch-id order, so concurrent acks and
closes never deadlock), read the named groups' sizes, validate, then one statement that clears
the masked bits of every group, lowers each group's and each batch's pending by the number of
bits that actually flipped (`bit_count(bits & mask)`), completes the batches that became
`closed and pending = 0` and writes their completion events. Duplicates flip nothing, so they
never double count; a re-ack after completion reports only duplicates.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping

from psycopg import sql

from .batches import completion_insert
from .errors import BatchExpired, IndexOutOfRange, UnknownBatch, UnknownGroup
from .ids import GroupMask, format_run
from .steps import Op, Query, Round


@dataclass
class AckResult:
    acked: int = 0           # bits this call cleared
    duplicates: int = 0      # ids whose bit was already clear (or named twice in the call)
    completed: list[int] = field(default_factory=list)  # batches this call completed
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item id or run, reason), reject_invalid only


@functools.lru_cache(maxsize=64)
def statements(schema: str, outbox_table: str) -> dict[str, str]:
    t = {"batch": sql.Identifier(schema, "batch"), "group": sql.Identifier(schema, "batch_group")}
    q = {
        "lock": sql.SQL("SELECT id, state FROM {batch} WHERE id = ANY(%s) ORDER BY id FOR NO KEY UPDATE"),
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
            " b.completion_topic, b.traceparent, b.tracestate),"
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


def apply_op(q: dict[str, str], masks: Mapping[tuple[int, int], GroupMask], completion_topic: str,
             reject_invalid: bool, *, last: bool = True) -> Op[AckResult]:
    """Apply folded masks (from `tracker.ids.fold`) in the caller's transaction.

    reject_invalid=False: the first unknown batch/group, out-of-range index or expired batch raises
    its typed error and nothing is applied. reject_invalid=True: those entries are left out and
    returned in `rejected` as (item id or run, reason); the valid rest is applied.
    """
    result = AckResult()
    todo = [m for m in masks.values() if m.count]
    if not todo:
        return result
    # One round trip: savepoint, batch locks (in id order), then the groups' sizes, read after
    # the locks are held so that an add committed while we waited is seen.
    lock_rows, size_rows = yield Round((
        Query(q["lock"], [sorted({m.batch_id for m in todo})], "all"),
        Query(q["sizes"], [[m.batch_id for m in todo], [m.group_id for m in todo]], "all")))
    states = dict(lock_rows)  # type: ignore[arg-type]
    sizes = {(b, g): size for b, g, size in size_rows}  # type: ignore[union-attr]
    live: list[GroupMask] = []
    for m in todo:
        state = states.get(m.batch_id)
        if state is None or state == "expired":
            first = m.item_id(_first_index(m))
            if not reject_invalid:
                raise UnknownBatch(m.batch_id, first) if state is None else BatchExpired(m.batch_id, first)
            reason = "unknown batch" if state is None else "batch expired"
            result.rejected.extend((run, reason) for run in _runs(m))
        else:
            live.append(m)
    batch_ids, group_ids, hexes = [], [], []
    counted = 0
    for m in live:
        size = sizes.get((m.batch_id, m.group_id))
        if size is None:
            if not reject_invalid:
                raise UnknownGroup(m.batch_id, m.group_id, m.item_id(_first_index(m)))
            result.rejected.extend((run, "unknown group") for run in _runs(m))
            continue
        count = m.count
        if m.max_index >= size:
            if not reject_invalid:
                raise IndexOutOfRange(m.item_id(_first_index(m, size)), size, culprit=(m.batch_id, m.group_id))
            result.rejected.extend((run, f"index out of range (group size {size})") for run in _runs(m, size))
            count -= _set_bits_from(m, size)
        nbytes = (size + 7) >> 3
        bits = m.bits
        if len(bits) != nbytes:
            bits = bits[:nbytes] if len(bits) > nbytes else bits + bytes(nbytes - len(bits))
        batch_ids.append(m.batch_id)
        group_ids.append(m.group_id)
        hexes.append(bits.hex())
        counted += count
    if not batch_ids:
        return result
    (applied,) = yield Round((Query(q["apply"], [batch_ids, group_ids, hexes, completion_topic], "all"),), last)
    for batch_id, flipped, completed in applied:  # type: ignore[union-attr]
        result.acked += flipped
        if completed:
            result.completed.append(batch_id)
    result.duplicates = max(0, counted - result.acked)
    return result
