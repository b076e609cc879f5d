"""Item ids: '<batch_id>:<group_id>:<index>' (decimal, 0 <= index < group size).

The run form '<batch_id>:<group_id>:<start>-<end>' (end inclusive) names contiguous indexes, so a
consumer acking a whole range sends one string. Clients expand {group, upto} into ids themselves.

Writing ids is here; reading, checking and folding them is tracker.folding's (the one folder every
path shares), re-exported here under the names applications have always used.
"""

from __future__ import annotations

from tracker.errors import InvalidArgument, InvalidValue
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


def _whole(value: object, name: str, high: int) -> int:
    """An int (not a bool) between 0 and `high`, else a typed error naming it as given."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(name, value, f"an int between 0 and {high}")
    if not 0 <= value <= high:
        raise InvalidValue(name, value, f"must be between 0 and {high}")
    return value


def format_item_id(batch_id: int, group_id: int, index: int) -> str:
    """'<batch_id>:<group_id>:<index>'; each part checked as parse_item_id reads it."""
    _whole(batch_id, "batch_id", ID_MAX)
    _whole(group_id, "group_id", ID_MAX)
    _whole(index, "index", GROUP_BITS_MAX - 1)
    return f"{batch_id}:{group_id}:{index}"


def format_run(batch_id: int, group_id: int, start: int, end: int) -> str:
    """'<batch_id>:<group_id>:<start>-<end>' (end inclusive), or the one id when start == end."""
    _whole(batch_id, "batch_id", ID_MAX)
    _whole(group_id, "group_id", ID_MAX)
    _whole(start, "start", GROUP_BITS_MAX - 1)
    if _whole(end, "end", GROUP_BITS_MAX - 1) < start:
        raise InvalidValue("end", end, f"must be >= start ({start})")
    return f"{batch_id}:{group_id}:{start}" if start == end else f"{batch_id}:{group_id}:{start}-{end}"


def expand(batch_id: int, group_id: int, upto: int) -> list[str]:
    """All ids of a group of `upto` items (at most GROUP_BITS_MAX): indexes 0..upto-1."""
    _whole(batch_id, "batch_id", ID_MAX)
    _whole(group_id, "group_id", ID_MAX)
    _whole(upto, "upto", GROUP_BITS_MAX)
    prefix = f"{batch_id}:{group_id}:"
    return [prefix + str(i) for i in range(upto)]
