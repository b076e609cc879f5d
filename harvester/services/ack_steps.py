"""The acker's steps: what one statement applies, and a list of them merged into the fewest.

A fold of the ack topic comes as steps (tracker.folding.Folded.steps): acks, or failures of one
reason, each batch's in the order they were read. Masks the acker deferred (their batch was held
by another transaction) go before the next fold's, and `relevel` merges the two lists into as few
statements as keep every batch's order. Pure: no database, no Kafka.
"""

from __future__ import annotations

from tracker.ids import GroupMask

# (reason or None for acks, masks): what one statement applies; a list of them is applied in order
Step = tuple[str | None, dict[tuple[int, int], GroupMask]]


def masks_in(steps: list[Step]) -> int:
    """The masks the steps hold: what counts against a fold's bound of groups."""
    return sum(len(masks) for _r, masks in steps)


def relevel(steps: list[Step]) -> list[Step]:
    """The same steps in few statements, each batch's order kept. A batch's outcomes are runs of
    acks and of failures (a run of failures under one or more reasons, kept disjoint: the earlier
    reason keeps an item); the runs of each batch in turn (in order of first appearance) are placed
    in order into the levels built so far, each run into an existing level or a new one inserted
    between them, choosing the placement that adds the fewest statements (a statement per (level,
    reason)). Masks are merged into copies: the given ones are left as they were."""
    # batch -> its runs in order: (failed, reason -> (batch, group) -> mask)
    runs: dict[int, list[tuple[bool, dict[str | None, dict[tuple[int, int], GroupMask]]]]] = {}
    for reason, masks in steps:
        failed = reason is not None
        for key, mask in masks.items():
            mine = runs.setdefault(key[0], [])
            if not mine or mine[-1][0] != failed:
                mine.append((failed, {}))
            by_reason = mine[-1][1]
            if failed:
                taken = 0
                for other, held in by_reason.items():
                    if other != reason and key in held:
                        taken |= int.from_bytes(held[key].bits.ljust(len(mask.bits), b"\0")[: len(mask.bits)], "big")
                if taken:
                    bits = int.from_bytes(mask.bits, "big") & ~taken
                    mask = GroupMask(
                        mask.batch_id,
                        mask.group_id,
                        bytearray(bits.to_bytes(len(mask.bits), "big")),
                        mask.max_index,
                        mask.count,
                    )
            into = by_reason.setdefault(reason, {})
            before = into.get(key)
            if before is None:
                into[key] = mask
            else:
                copy = GroupMask(
                    before.batch_id, before.group_id, bytearray(before.bits), before.max_index, before.count
                )
                copy.merge(mask)
                into[key] = copy
    levels: list[dict[str | None, dict[tuple[int, int], GroupMask]]] = []
    for mine in runs.values():
        levels = _place(levels, [by_reason for _failed, by_reason in mine])
    return [(reason, masks) for level in levels for reason, masks in level.items()]


def _place(
    levels: list[dict[str | None, dict[tuple[int, int], GroupMask]]],
    runs: list[dict[str | None, dict[tuple[int, int], GroupMask]]],
) -> list[dict[str | None, dict[tuple[int, int], GroupMask]]]:
    """The levels with one batch's runs placed in order, fewest statements added: an alignment of
    the runs with the levels, each run joining a level (a statement for each of its reasons the
    level lacks) or a new level inserted (a statement for each of its reasons)."""
    n, k = len(levels), len(runs)
    join = [[sum(r not in level for r in run) for level in levels] for run in runs]
    cost = [[0] * (n + 1) for _ in range(k + 1)]
    for i in range(1, k + 1):
        cost[i][0] = cost[i - 1][0] + len(runs[i - 1])
        for j in range(1, n + 1):
            cost[i][j] = min(
                cost[i][j - 1],  # level j-1 holds none of these runs
                cost[i - 1][j - 1] + join[i - 1][j - 1],  # run i-1 joins level j-1
                cost[i - 1][j] + len(runs[i - 1]),  # run i-1 in a new level after level j-1
            )
    joins: dict[int, int] = {}  # run -> the level it joins
    new: dict[int, list[int]] = {}  # j -> runs in new levels inserted before level j, in order
    i, j = k, n
    while i > 0:
        if j > 0 and cost[i][j] == cost[i - 1][j - 1] + join[i - 1][j - 1]:
            joins[i - 1] = j - 1
            i, j = i - 1, j - 1
        elif j > 0 and cost[i][j] == cost[i][j - 1]:
            j -= 1
        else:
            new.setdefault(j, []).insert(0, i - 1)
            i -= 1
    out: list[dict[str | None, dict[tuple[int, int], GroupMask]]] = []
    for j in range(n + 1):
        out.extend({reason: dict(masks) for reason, masks in runs[r].items()} for r in new.get(j, ()))
        if j < n:
            out.append(levels[j])
    for r, j in joins.items():
        for reason, masks in runs[r].items():
            levels[j].setdefault(reason, {}).update(masks)
    return out
