"""Item ids: '<batch_id>:<group_id>:<index>' (decimal, 0 <= index < group size).

The run form '<batch_id>:<group_id>:<start>-<end>' (end inclusive) names contiguous indexes, so a
consumer acking a whole range sends one string. Clients expand {group, upto} into ids themselves.

Writing ids is here; reading, checking and folding them is tracker.folding's (the one folder every
path shares), re-exported here under the names applications have always used.
"""

from __future__ import annotations

from tracker.folding import (
    GROUP_BITS_MAX,
    GROUPS_PER_FOLD_MAX,
    ID_MAX,
    MASK_BYTES_MAX,
    GroupMask,
    IdRun,
    ItemId,
    fold,
    iter_ids,
    parse_ack,
    parse_item_id,
)

__all__ = [
    "GROUP_BITS_MAX",
    "GROUPS_PER_FOLD_MAX",
    "ID_MAX",
    "MASK_BYTES_MAX",
    "GroupMask",
    "IdRun",
    "ItemId",
    "expand",
    "fold",
    "format_item_id",
    "format_run",
    "iter_ids",
    "parse_ack",
    "parse_item_id",
]


def format_item_id(batch_id: int, group_id: int, index: int) -> str:
    return f"{batch_id}:{group_id}:{index}"


def format_run(batch_id: int, group_id: int, start: int, end: int) -> str:
    return f"{batch_id}:{group_id}:{start}" if start == end else f"{batch_id}:{group_id}:{start}-{end}"


def expand(batch_id: int, group_id: int, upto: int) -> list[str]:
    """All ids of a group of `upto` items: indexes 0..upto-1."""
    prefix = f"{batch_id}:{group_id}:"
    return [prefix + str(i) for i in range(upto)]
