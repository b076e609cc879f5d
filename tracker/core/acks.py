"""Acks: fold item ids into one mask per group; two ways to apply them.

`claim_op` (`Tracker.ack`, `exactly_once`: consumers, in the caller's transaction): no batch or
group row is locked or updated, so consumers of one batch never wait on each other's transactions. One claim row per item is inserted into `ack_claim`, whose primary key is
the per-item exclusion: a concurrent claim of the same item waits on the unique index until the
first transaction ends, then finds its committed claim (a duplicate) or, once settled, the cleared
bit. The bit is then read by a fresh statement (READ COMMITTED: it sees what the wait waited for;
REPEATABLE READ / SERIALIZABLE: `ack_fresh_check` raises a serialization failure if the group row
changed since the snapshot or is being changed right now, instead of handing a stale "still
pending" to exactly_once; it never waits and keeps no lock, so it never holds a settle up). An
item counts as acked by this call if its claim is new and its bit still set. Bits, pending counts
and the completion decision are folded at commit by `ack_settle` (sql/R__ack_claims.sql) under
the batch row lock, or later by the next settle of the batch (tracker.settle) if that lock was
busy at commit. So acks of one batch, and their effects, commit in parallel; `completed` is
always empty here (completion happens at or after commit).

`apply_op` (`Tracker.apply_masks`: the reaper's acker, Spark, in their own short transactions): lock the named batches
(FOR NO KEY UPDATE, in descending batch-id order, so concurrent acks and closes never deadlock; a
finishing child never locks its parent, it leaves a row the parent folds in later; optionally
SKIP LOCKED, returning what it skipped), read the named groups' sizes, validate, then one
statement that clears the masked bits of every group, lowers each group's and each batch's
pending by the number of bits that actually flipped (`bit_count(bits & mask)`), completes the
batches that became `closed and pending = 0` and writes their completion events. Duplicates flip
nothing, so they never double count; a re-ack after completion reports only duplicates.

Both paths count flips against the bits as they are under the batch row lock, so they agree on
counts and on the one completion whichever of them clears a bit first.

`exactly_once_op` (`Tracker.exactly_once`): a claim of one item, then the caller's effect only if
the claim cleared something.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from psycopg import sql

from tracker.core.batches import render
from tracker.core.steps import Effect, Op, Query, Round, one
from tracker.errors import BatchExpired, IndexOutOfRange, InvalidArgument, UnknownBatch, UnknownGroup
from tracker.ids import GroupMask, fold, format_run, parse_item_id

T = TypeVar("T")

# `Tracker.ack` claims item by item up to this many ids per call; a larger call is a bulk ack and
# takes the masked path (apply_op: batch rows locked until the caller commits, `completed` filled).
CLAIMS_PER_CALL_MAX = 1000


@dataclass
class AckResult:
    # bits this call cleared; for claims (tracker.ack of <= CLAIMS_PER_CALL_MAX ids): items claimed whose
    # bit was set when claimed (a concurrent masked ack may clear that bit first; stored counts stay exact)
    acked: int = 0
    duplicates: int = 0  # ids whose bit was already clear (or named twice in the call)
    completed: list[int] = field(default_factory=list)  # batches this call completed
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (item id or run, reason), reject_invalid only
    # apply_op(skip_locked=True): masks of batches another transaction held locked, not applied
    skipped: dict[tuple[int, int], GroupMask] = field(default_factory=dict)


@dataclass
class FailResult:
    """What `fail` did: items this call failed (their bit was still set), ids already finished
    (acked or failed before: the first outcome recorded for an item wins) and batches it finished."""

    failed: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class FailurePage:
    """One page of a batch's failed items: (item id, reason) in (group, index) order; `next` is the
    cursor of the next page (pass it as `after`), None on the last page."""

    items: list[tuple[str, str]]
    next: str | None


FAILURES_LIMIT_MAX = 1000


@functools.lru_cache(maxsize=64)
def statements(schema: str, outbox_table: str) -> dict[str, str]:
    q = {
        "lock": sql.SQL("SELECT id, state FROM {batch} WHERE id = ANY(%s) ORDER BY id DESC FOR NO KEY UPDATE"),
        "lock_skip": sql.SQL(
            "SELECT id, state FROM {batch} WHERE id = ANY(%s) ORDER BY id DESC FOR NO KEY UPDATE SKIP LOCKED"
        ),
        "states": sql.SQL("SELECT id, state FROM {batch} WHERE id = ANY(%s)"),
        # validate + claim + read + freshness check in one statement (sql/R__ack_claims.sql)
        "claim_items": sql.SQL(
            "SELECT * FROM {claim_items}(%s::int8[], %s::int8[], %s::int4[], {outbox}::regclass, %s)"
        ),
        "sizes": sql.SQL(
            "SELECT g.batch_id, g.id, g.size FROM unnest(%s::int8[], %s::int8[]) AS u(batch_id, id) "
            "JOIN {group} g ON g.batch_id = u.batch_id AND g.id = u.id"
        ),
        # Clear the masked bits, count flips (as failures under `reason` when it is not null),
        # finish what can: outcome_apply (sql/R__outcomes.sql), under the locks taken above.
        "apply": sql.SQL(
            "SELECT batch_id, flipped, completed FROM {apply}(%s::int8[], %s::int8[], %s::text[], %s::text, "
            "{outbox}::regclass, %s)"
        ),
        "exists": sql.SQL("SELECT 1 FROM {batch} WHERE id = %s"),
        # A page walked group by group (sql/R__sql_api.sql: failures).
        "failures": sql.SQL("SELECT item_id, reason FROM {failures}(%s::int8, %s::text, %s::int4)"),
    }
    return render(schema, outbox_table, q, claim_items="ack_claim_items", apply="outcome_apply", failures="failures")


def _first_index(mask: GroupMask, lo: int = 0) -> int:
    return next(mask.indexes(lo), lo)


def _runs(mask: GroupMask, lo: int = 0) -> list[str]:
    """The set bits at or above `lo`, as ids and runs (for rejects)."""
    out: list[str] = []
    start = prev = -2
    for i in mask.indexes(lo):
        if start >= 0 and i != prev + 1:
            out.append(format_run(mask.batch_id, mask.group_id, start, prev))
            start = -2
        if start < 0:
            start = i
        prev = i
    if start >= 0:
        out.append(format_run(mask.batch_id, mask.group_id, start, prev))
    return out


def _set_bits_from(mask: GroupMask, lo: int) -> int:
    total = 0
    first_byte = lo >> 3
    if lo & 7 and first_byte < len(mask.bits):
        total += bin(mask.bits[first_byte] & (0xFF >> (lo & 7))).count("1")
        first_byte += 1
    return total + int.from_bytes(mask.bits[first_byte:], "big").bit_count()


def apply_op(
    q: dict[str, str],
    masks: Mapping[tuple[int, int], GroupMask],
    completion_topic: str,
    reject_invalid: bool,
    *,
    last: bool = True,
    skip_locked: bool = False,
    reason: str | None = None,
) -> Op[AckResult]:
    """Apply folded masks (from `tracker.ids.fold`) in the caller's transaction.

    reject_invalid=False: the first unknown batch/group, out-of-range index or expired batch raises
    its typed error and nothing is applied. reject_invalid=True: those entries are left out and
    returned in `rejected` as (item id or run, reason); the valid rest is applied.
    skip_locked=True: batches another transaction holds locked are not waited for; their masks
    come back in `skipped`, to be applied later (the acker).
    reason (checked by the caller: tracker.core.validate.check_reason): the items flipped fail
    under it instead of succeeding; `acked` then counts the items this call failed.
    """
    (result,) = yield from apply_steps_op(
        q, [(reason, masks)], completion_topic, reject_invalid, last=last, skip_locked=skip_locked
    )
    return result


def apply_steps_op(
    q: dict[str, str],
    steps: Sequence[tuple[str | None, Mapping[tuple[int, int], GroupMask]]],
    completion_topic: str,
    reject_invalid: bool,
    *,
    last: bool = True,
    skip_locked: bool = False,
) -> Op[list[AckResult]]:
    """`apply_op` of each (reason or None for acks, masks) step in order, in two round trips
    whatever the number of steps: every named batch locked at once (so a batch held elsewhere is
    skipped in every step: its masks come back in each step's `skipped`), the groups' sizes read
    once, then one statement per step with masks to apply, sent together and run in order. A
    result per step; with reject_invalid=False the first invalid entry of any step raises and
    nothing is applied."""
    results = [AckResult() for _ in steps]
    todos = [[m for m in masks.values() if m.count] for _reason, masks in steps]
    if not any(todos):
        return results
    batch_ids = sorted({m.batch_id for todo in todos for m in todo})
    keys = list(dict.fromkeys((m.batch_id, m.group_id) for todo in todos for m in todo))
    # One round trip: batch locks (in id order), then the groups' sizes, read after the locks are
    # held so that an add committed while we waited is seen.
    queries = [
        Query(q["lock_skip" if skip_locked else "lock"], [batch_ids], "all"),
        Query(q["sizes"], [[b for b, _g in keys], [g for _b, g in keys]], "all"),
    ]
    if skip_locked:
        queries.append(Query(q["states"], [batch_ids], "all"))
    rows = yield Round(tuple(queries))
    lock_rows, size_rows = rows[0], rows[1]
    states = dict(lock_rows)
    held: set[int] = set()
    if skip_locked:
        held = {b for b, _state in rows[2]} - states.keys()
    sizes = {(b, g): size for b, g, size in size_rows}
    statements: list[tuple[int, int, Query]] = []  # (step, ids it names, statement)
    for n, (result, todo) in enumerate(zip(results, todos)):
        if held:
            result.skipped = {(m.batch_id, m.group_id): m for m in todo if m.batch_id in held}
            todo = [m for m in todo if m.batch_id not in held]
        live: list[GroupMask] = []
        for m in todo:
            state = states.get(m.batch_id)
            if state is None or state == "expired":
                first = m.item_id(_first_index(m))
                if not reject_invalid:
                    raise UnknownBatch(m.batch_id, first) if state is None else BatchExpired(m.batch_id, first)
                why = "unknown batch" if state is None else "batch expired"
                result.rejected.extend((run, why) for run in _runs(m))
            else:
                live.append(m)
        batch_of, group_of, hexes = [], [], []
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
            # Sent as folded (up to its highest index, never past the group): the statement pads it
            # to the group's size, so what this call holds stays what its ids named.
            nbytes = (size + 7) >> 3
            bits = m.bits if len(m.bits) <= nbytes else m.bits[:nbytes]
            batch_of.append(m.batch_id)
            group_of.append(m.group_id)
            hexes.append(bits.hex())
            counted += count
        if batch_of:
            reason = steps[n][0]
            query = Query(q["apply"], [batch_of, group_of, hexes, reason, completion_topic], "all")
            statements.append((n, counted, query))
    if not statements:
        return results
    applied = yield Round(tuple(query for _n, _c, query in statements), last)
    for (n, counted, _query), rows_of_step in zip(statements, applied):
        result = results[n]
        for batch_id, flipped, completed in rows_of_step:
            result.acked += flipped
            if completed:
                result.completed.append(batch_id)
        result.duplicates = max(0, counted - result.acked)
    return results


def claim_op(
    q: dict[str, str], masks: Mapping[tuple[int, int], GroupMask], completion_topic: str, *, last: bool = True
) -> Op[AckResult]:
    """Ack folded masks in the caller's transaction by claiming their items (see the module doc):
    no batch-wide lock; counts, bits and completion are settled at commit (or by the next settle).

    Raises UnknownBatch, UnknownGroup, IndexOutOfRange or BatchExpired naming the first offending
    id; then nothing of the call was applied. `acked`: items whose claim is new in this
    transaction and whose bit was still set; the rest are `duplicates`; `completed` stays empty.

    One statement, `ack_claim_items` (sql/R__ack_claims.sql): it validates first and claims nothing when an id
    is bad, returning what the typed error needs instead. last=True (an ack): the round also ends
    the call; last=False (exactly_once: an effect follows).
    """
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
    (rows,) = yield Round((Query(q["claim_items"], [b_col, g_col, i_col, completion_topic], "all"),), last)
    if rows and rows[0][5] is None:  # validation rows: something named is bad, nothing was claimed
        _claimable(
            todo,
            [(b, state) for b, _g, _i, state, _size, _c, _bit in rows if state is not None],
            [(b, g, size) for b, g, _i, _state, size, _c, _bit in rows if size is not None],
        )
        raise AssertionError(f"ack_claim_items refused {len(rows)} group(s) the checks here accept")  # pragma: no cover
    counted = sum(m.count for m in todo)
    result.acked = sum(1 for _b, _g, _i, _state, _size, claimed, bit in rows if claimed and bit == 1)
    result.duplicates = max(0, counted - result.acked)
    return result


def _claimable(todo: list[GroupMask], state_rows: list[tuple], size_rows: list[tuple]) -> int:
    """Raise the typed error of the first bad mask; else the number of ids the masks count."""
    states = dict(state_rows)
    sizes = {(b, g): size for b, g, size in size_rows}
    counted = 0
    for m in todo:
        state = states.get(m.batch_id)
        if state is None or state == "expired":
            first = m.item_id(_first_index(m))
            raise UnknownBatch(m.batch_id, first) if state is None else BatchExpired(m.batch_id, first)
        size = sizes.get((m.batch_id, m.group_id))
        if size is None:
            raise UnknownGroup(m.batch_id, m.group_id, m.item_id(_first_index(m)))
        if m.max_index >= size:
            raise IndexOutOfRange(m.item_id(_first_index(m, size)), size, culprit=(m.batch_id, m.group_id))
        counted += m.count
    return counted


# ---------------------------------------------------------------- exactly-once effects


@dataclass
class Processed(Generic[T]):
    first_time: bool  # this call cleared the bit and ran the effect
    value: T | None  # what the effect returned (None when it did not run)
    ack: AckResult


def exactly_once_op(q: dict[str, str], item_id: object, completion_topic: str) -> Op[Processed[object]]:
    """Ack `item_id` and, only if this call is the first to ack it, run the caller's effect, in one
    savepoint of the caller's transaction (nothing is committed here).

    The ack goes first and is a claim (tracker.core.acks.claim_op): it locks this one item, not its
    batch or group, so the consumers of one batch run their effects in parallel. A concurrent
    redelivery of the same item waits on the claim until this transaction ends, then finds the
    item acked and skips the effect. Under REPEATABLE READ / SERIALIZABLE a redelivery whose
    snapshot predates the first one's settle gets a serialization failure (retry the
    transaction), never a second effect. If the effect raises, the claim is rolled back with it
    and the error propagates: the item stays pending and a redelivery processes it again.
    """
    if not isinstance(item_id, (str, bytes)):
        raise InvalidArgument("item_id", item_id, "one item id (str or bytes)")
    run = parse_item_id(item_id)  # one item, not a run: one effect
    result = yield from claim_op(q, fold([str(run)]), completion_topic, last=False)
    if result.acked == 0:
        return Processed(False, None, result)
    value = yield Effect()
    return Processed(True, value, result)


def fail_op(
    q: dict[str, str], masks: Mapping[tuple[int, int], GroupMask], completion_topic: str, reason: str
) -> Op[FailResult]:
    """Fail folded masks under `reason` (checked: tracker.core.validate.check_reason) in the caller's
    transaction. Failures take the masked path (apply_op), not claims: a failure is rare, and the
    masked path records it, its reason and any finish (threshold or last item) at once; it holds
    the named batches' row locks until the caller commits."""
    got = yield from apply_op(q, masks, completion_topic, False, reason=reason)
    return FailResult(got.acked, got.duplicates, got.completed)


def failures_op(q: dict[str, str], batch_id: int, after: str | None, limit: int) -> Op[FailurePage]:
    """A page of the batch's failed items after the item id `after` (checked by the caller)."""
    (exists,) = yield one(q["exists"], [batch_id])
    if exists is None:
        raise UnknownBatch(batch_id)
    (rows,) = yield Round((Query(q["failures"], [batch_id, after, limit], "all"),), True)
    items = [(item_id, reason) for item_id, reason in rows]
    return FailurePage(items, items[-1][0] if len(items) == limit else None)
