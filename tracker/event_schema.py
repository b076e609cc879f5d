"""JSON Schemas (draft 2020-12) of the events the tracker writes through the outbox: a batch's
completion and its expiry. Consumers can validate with them; the documentation's event reference
is generated from them, and the tests validate real events against them, so the three agree.

Schema version 2 only adds keys to version 1, so a version 1 consumer keeps working; both schemas
allow keys they do not name (a later version adds more)."""

from __future__ import annotations

from typing import Final

JsonSchema = dict[str, object]

_COUNT: Final[JsonSchema] = {"type": "integer", "minimum": 0}
_TIME: Final[JsonSchema] = {"type": "string", "format": "date-time"}
_TIME_OR_NULL: Final[JsonSchema] = {"type": ["string", "null"], "format": "date-time"}


def _object(properties: dict[str, JsonSchema], description: str) -> JsonSchema:
    return {
        "type": "object",
        "description": description,
        "properties": properties,
        "required": list(properties),
    }


_CHILDREN: Final = _object(
    {
        "total": {**_COUNT, "description": "children opened under the batch"},
        "failed": {**_COUNT, "description": "children that finished failed or expired"},
    },
    "The batch's direct children.",
)
_ROLLUP: Final = _object(
    {
        "total": {**_COUNT, "description": "its items and those of every descendant that finished before it"},
        "succeeded": {**_COUNT, "description": "of those, the items that succeeded"},
        "failed": {
            **_COUNT,
            "description": "of those, the items that failed, or were still pending at an early finish or an expiry",
        },
    },
    "What the batch counts for its parent: succeeded + failed = total.",
)

# Keys both events carry, as version 2 writes them.
_COMMON: Final[dict[str, JsonSchema]] = {
    "schema_version": {"const": 2, "description": "2 (absent in version 1)"},
    "batch_id": {
        "type": "integer",
        "minimum": 1,
        "description": "the batch; also the record's key and `batch-id` header",
    },
    "user_key": {"type": ["string", "null"], "description": "the key the application gave the batch, if any"},
    "total": {**_COUNT, "description": "items added to the batch"},
    "succeeded": {**_COUNT, "description": "its own items that succeeded"},
    "failed": {**_COUNT, "description": "its own items that failed"},
    "pending": {**_COUNT, "description": "its own items with no outcome"},
    "parent_id": {"type": ["integer", "null"], "description": "the parent batch, or null"},
    "children": _CHILDREN,
    "rollup": _ROLLUP,
    "opened_at": {**_TIME, "description": "when the batch was opened"},
    "closed_at": {
        **_TIME_OR_NULL,
        "description": "when it was closed (null: it expired, or crossed tolerated_failures, while still open)",
    },
}

COMPLETED: Final[JsonSchema] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "batch.completed",
    "description": (
        "Written once, by the transaction that finishes a batch: a closed one whose last item got an "
        "outcome or whose last child finished, or one that crossed a failure threshold (an early finish, "
        "`pending` > 0; `tolerated_failures` finishes it even while it is open, `closed_at` null). "
        "Topic: the batch's completion topic; for a batch opened without one, the default of whatever finishes "
        "it (the reaper's `harvester.default_completion_topic`, a Tracker's `completion_topic`, the SQL "
        "functions' `completion_topic` argument: each `batch-completions` unless set, so keep them alike)."
    ),
    "type": "object",
    "properties": {
        "event": {"const": "batch.completed", "description": "what happened"},
        "outcome": {
            "enum": ["succeeded", "failed"],
            "description": "failed when an item or a child failed, or a threshold finished it early",
        },
        **_COMMON,
        "completed_at": {**_TIME, "description": "when it finished"},
    },
    "required": ["event", "outcome", *_COMMON, "completed_at"],
}

EXPIRED: Final[JsonSchema] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "expired",
    "description": (
        "Written once, by the statement that expires a batch: the sweeper (idle too long) or an operator "
        "(`reaper batch expire`). Topic: the sweeper's expiry topic if set, else the batch's completion "
        "topic, else the default completion topic. The record also has the header `event: batch-expired`."
    ),
    "type": "object",
    "properties": {
        "event": {"const": "expired", "description": "what happened"},
        "outcome": {"const": "expired", "description": "always expired"},
        **_COMMON,
        "acked": {**_COUNT, "description": "version 1's total - pending: items that succeeded or failed"},
        "state": {"enum": ["open", "closed"], "description": "what the batch was when it expired"},
        "reason": {"type": "string", "description": "idle (the sweeper) or operator (`reaper batch expire`)"},
        "last_activity_at": {**_TIME, "description": "its last add, outcome or close"},
        "expired_at": {**_TIME, "description": "when it expired"},
        "idle_expiry_seconds": {"type": "number", "description": "the sweeper's idle limit (reason idle)"},
        "note": {"type": "string", "description": "the operator's note, when one was given (reason operator)"},
    },
    "required": ["event", "outcome", *_COMMON, "acked", "state", "reason", "last_activity_at", "expired_at"],
}

SCHEMAS: Final[dict[str, JsonSchema]] = {"batch-completed": COMPLETED, "batch-expired": EXPIRED}
