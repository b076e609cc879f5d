"""The SQL functions' errors (SQLSTATE RT001 to RT008, sql/R__sql_api.sql) as the tracker's typed
exceptions: the sql backend answers as the tracker backend does. DETAIL holds the offending value."""

from __future__ import annotations

import re

import psycopg

from tracker.errors import (
    BatchExpired,
    BatchNotOpen,
    DepthExceeded,
    IndexOutOfRange,
    InvalidValue,
    MalformedItemId,
    ParentNotOpen,
    TooManyGroups,
    TrackerError,
    UnknownBatch,
    UnknownGroup,
)
from tracker.ids import GROUP_BITS_MAX, MASK_BYTES_MAX

_SIZE = re.compile(r"its group has (\d+) items")
_STATE = re.compile(r"^batch \d+ is (\w+):")
_PARENT_STATE = re.compile(r"^parent batch \d+ is (\w+):")
_PARENT_DEPTH = re.compile(r"^parent batch \d+ is at depth (\d+)")
_DEPTH_MAX = 7  # the deepest a batch can be: batches nest at most 8 levels


def tracker_error(exc: psycopg.Error) -> TrackerError | None:
    """The typed tracker error an RT SQLSTATE stands for (DETAIL holds the offending value)."""
    code, detail = exc.sqlstate or "", exc.diag.message_detail or ""
    message = exc.diag.message_primary or ""
    parts = detail.split(":")
    item_id = detail if len(parts) == 3 else None
    try:
        batch_id = int(parts[0])
    except ValueError:
        batch_id = -1
    if code == "RT001":
        return MalformedItemId(detail)
    if code == "RT002":  # open_batch names an unknown parent as such, as the tracker does
        return UnknownBatch(batch_id, item_id, role="parent" if message.endswith("(parent)") else None)
    if code == "RT003":
        return UnknownGroup(batch_id, int(parts[1]), item_id)
    if code == "RT004":
        size = _SIZE.search(message)
        return (
            IndexOutOfRange(detail, int(size.group(1)))
            if size
            else IndexOutOfRange(detail, GROUP_BITS_MAX, any_group=True)
        )
    if code == "RT005" and (parent := _PARENT_STATE.search(message)):
        return ParentNotOpen(batch_id, parent.group(1))
    if code == "RT007" and (depth := _PARENT_DEPTH.search(message)):
        return DepthExceeded(batch_id, int(depth.group(1)), _DEPTH_MAX)
    if code == "RT007":  # an invalid argument: its name leads the message, DETAIL holds its value
        return InvalidValue(message.split(" ", 1)[0], detail, message)
    if code == "RT005":
        state = _STATE.search(message)
        return BatchNotOpen(batch_id, state.group(1) if state else "not open")
    if code == "RT006":
        return BatchExpired(batch_id, item_id)
    if code == "RT008":
        return TooManyGroups("item_ids", detail, MASK_BYTES_MAX)
    return None
