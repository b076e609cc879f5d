"""Typed errors. Each names the offending id, batch or value; a call that raises changed nothing."""

from __future__ import annotations


class TrackerError(Exception):
    """Base class of every error the tracker raises on purpose."""


class InvalidIdentifier(TrackerError, ValueError):
    """A schema, table or role name from configuration that is not a plain SQL identifier, or a
    schema or outbox table name that leaves no room for the names derived from it."""

    def __init__(self, what: str, value: object, *, max_bytes: int = 63, room_for: str = "") -> None:
        """`room_for`: the names derived from `value` that its length would not leave room for."""
        self.what, self.value = what, value
        if room_for and isinstance(value, str):
            why = f"{len(value.encode())} bytes, at most {max_bytes} to leave room for {room_for}"
        else:
            why = f"use letters, digits and _ (start with a letter or _), at most {max_bytes} bytes"
        super().__init__(f"invalid {what} {value!r}: {why}")


class MalformedItemId(TrackerError, ValueError):
    """An item id that is not `<batch>:<group>:<index>` in plain decimals."""

    def __init__(self, item_id: object, reason: str = "") -> None:
        self.item_id, self.reason = item_id, reason
        why = f": {reason}" if reason else ""
        super().__init__(
            f"malformed item id {item_id!r}{why} (expected '<batch>:<group>:<index>' or '<batch>:<group>:<start>-<end>')"
        )


class UnknownBatch(TrackerError, LookupError):
    """A batch id that names no batch (or, over HTTP, another tenant's batch)."""

    def __init__(self, batch_id: int, item_id: str | None = None, *, role: str | None = None) -> None:
        self.batch_id, self.item_id, self.role = batch_id, item_id, role
        via = f" (item id {item_id!r})" if item_id else f" ({role})" if role else ""
        super().__init__(f"unknown batch {batch_id}{via}")


class UnknownGroup(TrackerError, LookupError):
    """An item id whose group does not exist in its batch."""

    def __init__(self, batch_id: int, group_id: int, item_id: str | None = None) -> None:
        self.batch_id, self.group_id, self.item_id = batch_id, group_id, item_id
        via = f" (item id {item_id!r})" if item_id else ""
        super().__init__(f"unknown group {group_id} in batch {batch_id}{via}")


class IndexOutOfRange(TrackerError, IndexError):
    """An item id whose index lies past the end of its group."""

    def __init__(
        self, item_id: str, size: int, *, any_group: bool = False, culprit: tuple[int, int] | None = None
    ) -> None:
        self.item_id, self.size = item_id, size
        self.culprit = culprit  # (batch, group) whose size was exceeded, when known
        if any_group:  # found while parsing, before the group was looked up
            super().__init__(f"item id {item_id!r} is out of range: no group holds more than {size} items")
        else:
            super().__init__(f"item id {item_id!r} is out of range: its group has {size} items (index 0..{size - 1})")


class BatchNotOpen(TrackerError):
    """Adding items to a batch that is closed, complete or expired."""

    def __init__(self, batch_id: int, state: str) -> None:
        self.batch_id, self.state = batch_id, state
        super().__init__(f"batch {batch_id} is {state}: items can only be added to an open batch")


class ParentNotOpen(TrackerError):
    """Opening a child batch under a parent that is closed, complete or expired."""

    def __init__(self, batch_id: int, state: str) -> None:
        self.batch_id, self.state = batch_id, state
        super().__init__(f"parent batch {batch_id} is {state}: children can only be opened under an open batch")


class DepthExceeded(TrackerError, ValueError):
    """Opening a child batch deeper than batches nest (8 levels: a top batch and 7 below it)."""

    def __init__(self, batch_id: int, depth: int, max_depth: int) -> None:
        self.batch_id, self.depth = batch_id, depth
        super().__init__(f"parent batch {batch_id} is at depth {depth}: batches nest at most {max_depth + 1} levels")


class BatchExpired(TrackerError):
    """Acking or closing a batch that the sweeper expired."""

    def __init__(self, batch_id: int, item_id: str | None = None) -> None:
        self.batch_id, self.item_id = batch_id, item_id
        via = f" (item id {item_id!r})" if item_id else ""
        super().__init__(f"batch {batch_id} has expired{via}")


def _shown(value: object, limit: int) -> str:
    """`value` as the caller wrote it (its repr), cut after `limit` characters."""
    try:
        shown = repr(value)
    except ValueError:  # an int past the interpreter's limit on digits converted to text
        return f"<an int of {value.bit_length():,} bits>" if isinstance(value, int) else "<unprintable>"
    return shown[:limit] + "..." if len(shown) > limit else shown


class InvalidArgument(TrackerError, TypeError):
    """An argument of the wrong type or shape (a whole argument, not one entry of it)."""

    def __init__(self, name: str, value: object, expected: str) -> None:
        self.name, self.value, self.expected = name, value, expected
        super().__init__(f"{name} must be {expected}, got {type(value).__name__} {_shown(value, 200)}")


class InvalidValue(TrackerError, ValueError):
    """A value the database could not store as written (NUL, text that is not UTF-8, a count past
    what one call may add, a header of an unsupported type). Names the value as the caller wrote it."""

    def __init__(self, name: str, value: object, reason: str) -> None:
        self.name, self.value, self.reason = name, value, reason
        super().__init__(f"{name} {_shown(value, 200)}: {reason}")


class TooManyGroups(TrackerError, ValueError):
    """One call names more groups than one fold may hold. What a fold allocates is bounded by the
    call's size and this limit, whatever the ids name; the call is refused before the masks of the
    groups past the limit are allocated, and nothing was applied. Split the ids into several calls."""

    def __init__(self, name: str, item_id: object, limit_bytes: int) -> None:
        self.name, self.item_id, self.limit_bytes = name, item_id, limit_bytes
        shown = _shown(item_id, 80)
        super().__init__(
            f"{name}: the entries up to {shown} name more groups than one call may fold "
            f"({limit_bytes:,} bytes of masks, at least {limit_bytes // 1024:,} whole groups of 8192 items); "
            "split them into several calls"
        )


class UnsupportedConnection(TrackerError, TypeError):
    """`session` is not a connection the tracker can run in."""

    SYNC = "a psycopg 3 Connection, or a SQLAlchemy Session/Connection on a postgresql+psycopg:// engine"
    ASYNC = (
        "a psycopg 3 AsyncConnection, an asyncpg Connection, or a SQLAlchemy AsyncSession/AsyncConnection "
        "on a postgresql+psycopg:// or postgresql+asyncpg:// engine"
    )

    def __init__(self, session: object, face: str, why: str = "") -> None:
        self.session = session
        expected = self.ASYNC if face == "async" else self.SYNC
        extra = f" ({why})" if why else ""
        super().__init__(
            f"cannot run the tracker ({face} face) in a {type(session).__module__}."
            f"{type(session).__qualname__}{extra}: expected {expected}"
        )


class CallerTransactionAborted(TrackerError):
    """The caller's transaction already failed; the tracker runs nothing in it."""

    def __init__(self) -> None:
        super().__init__("the caller's transaction is aborted (a statement in it failed): roll it back first")


class NoCallerTransaction(TrackerError):
    """A call that only holds inside the caller's transaction (an inbox claim: the effect must
    commit with it) on a connection with none open (autocommit, no transaction block). Nothing ran."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(
            f"{what} needs the caller's transaction: open one (conn.transaction(), or autocommit off),"
            " or use run_once, which runs the effect with the claim"
        )


class InboxError(TrackerError):
    """The database refused a claim for a reason of the inbox's own (not the input's)."""


class IsolationNotSupported(InboxError):
    """A claim inside a REPEATABLE READ transaction: its snapshot could miss an id committed
    meanwhile in an older partition. Use READ COMMITTED (the default) or SERIALIZABLE."""

    def __init__(self, level: str) -> None:
        self.level = level
        super().__init__(f"the inbox needs READ COMMITTED or SERIALIZABLE isolation, not {level.upper()}")


class NoInboxPartition(InboxError):
    """No partition holds the current time: the inbox maintenance has not run for longer than it
    makes partitions ahead (`reaper run` runs it; or tracker.inbox.retention.maintain)."""

    def __init__(self, at: str) -> None:
        self.at = at
        super().__init__(f"no inbox partition holds {at}: run the inbox maintenance (reaper run does)")


# The SQLSTATEs the SQL functions raise (class RT), what each means and the error the Python API
# raises for the same mistake. tests/test_docs.py checks that every code the SQL raises is here.
SQLSTATES: dict[str, tuple[str, tuple[type[TrackerError], ...]]] = {
    "RT001": ("a malformed item id", (MalformedItemId,)),
    "RT002": ("an unknown batch (or an unknown parent, named as such)", (UnknownBatch,)),
    "RT003": ("an unknown group", (UnknownGroup,)),
    "RT004": ("an item index out of range", (IndexOutOfRange,)),
    "RT005": (
        "a batch (or a parent) that is not open: adding to a closed, finished or expired batch",
        (BatchNotOpen, ParentNotOpen),
    ),
    "RT006": ("an expired batch (an outcome or a close)", (BatchExpired,)),
    "RT007": (
        "an invalid argument (its name leads the message, its value is in DETAIL), or a nesting too deep",
        (InvalidArgument, InvalidValue, DepthExceeded),
    ),
    "RT008": ("ids that name more groups than one call may fold (4 MiB of masks): split them", (TooManyGroups,)),
    "RT009": ("no inbox partition holds the current time: the inbox maintenance has not run", (NoInboxPartition,)),
    "RT010": ("an inbox claim under REPEATABLE READ (use READ COMMITTED or SERIALIZABLE)", (IsolationNotSupported,)),
}
