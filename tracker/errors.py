"""Typed errors. Each names the offending id, batch or value; a call that raises changed nothing."""
from __future__ import annotations


class TrackerError(Exception):
    """Base class of every error the tracker raises on purpose."""


class InvalidIdentifier(TrackerError, ValueError):
    def __init__(self, what: str, value: object) -> None:
        self.what, self.value = what, value
        super().__init__(f"invalid {what} {value!r}: use letters, digits and _ (start with a letter or _), at most 63 bytes")


class MalformedItemId(TrackerError, ValueError):
    def __init__(self, item_id: object, reason: str = "") -> None:
        self.item_id = item_id
        why = f": {reason}" if reason else ""
        super().__init__(f"malformed item id {item_id!r}{why} (expected '<batch>:<group>:<index>' or '<batch>:<group>:<start>-<end>')")


class UnknownBatch(TrackerError, LookupError):
    def __init__(self, batch_id: int, item_id: str | None = None) -> None:
        self.batch_id, self.item_id = batch_id, item_id
        via = f" (item id {item_id!r})" if item_id else ""
        super().__init__(f"unknown batch {batch_id}{via}")


class UnknownGroup(TrackerError, LookupError):
    def __init__(self, batch_id: int, group_id: int, item_id: str | None = None) -> None:
        self.batch_id, self.group_id, self.item_id = batch_id, group_id, item_id
        via = f" (item id {item_id!r})" if item_id else ""
        super().__init__(f"unknown group {group_id} in batch {batch_id}{via}")


class IndexOutOfRange(TrackerError, IndexError):
    def __init__(self, item_id: str, size: int, *, any_group: bool = False) -> None:
        self.item_id, self.size = item_id, size
        if any_group:  # found while parsing, before the group was looked up
            super().__init__(f"item id {item_id!r} is out of range: no group holds more than {size} items")
        else:
            super().__init__(f"item id {item_id!r} is out of range: its group has {size} items (index 0..{size - 1})")


class BatchNotOpen(TrackerError):
    """Adding items to a batch that is closed, complete or expired."""

    def __init__(self, batch_id: int, state: str) -> None:
        self.batch_id, self.state = batch_id, state
        super().__init__(f"batch {batch_id} is {state}: items can only be added to an open batch")


class BatchExpired(TrackerError):
    """Acking or closing a batch that the sweeper expired."""

    def __init__(self, batch_id: int, item_id: str | None = None) -> None:
        self.batch_id, self.item_id = batch_id, item_id
        via = f" (item id {item_id!r})" if item_id else ""
        super().__init__(f"batch {batch_id} has expired{via}")
