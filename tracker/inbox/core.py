"""The inbox's I/O-free core: validation, statements and operations (tracker/core/steps.py), shared
by the sync and asyncio faces (tracker/inbox/sync.py, tracker/inbox/aio.py).

A claim is one call of the SQL function `inbox_claim` (sql/R__inbox.sql), so every language
records ids the same way; `run_once` runs the caller's effect in the same savepoint, after the
claim and only when it was the first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter
from psycopg import sql

from tracker import metrics
from tracker.config import DEFAULT_SCHEMA
from tracker.core.steps import Effect, Op, one
from tracker.errors import (
    InboxError,
    InvalidArgument,
    InvalidValue,
    IsolationNotSupported,
    NoInboxPartition,
)
from tracker.schema import check_identifier

T = TypeVar("T")

# Message ids and consumer names: 1 to this many characters (the SQL functions say the same).
TEXT_MAX = 200


def check_text(name: str, value: object) -> str:
    """`value` as a str of 1 to TEXT_MAX characters (bytes: decoded as UTF-8), or InvalidArgument /
    InvalidValue naming it as written. Nothing allocates in proportion to a value past the limit."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value[: TEXT_MAX * 4 + 1])  # a longer value is refused below anyway
        if len(value) > TEXT_MAX * 4:
            raise InvalidValue(name, raw[:60], f"is longer than {TEXT_MAX} characters")
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidValue(name, raw, "is not UTF-8 text") from None
    if not isinstance(value, str):
        raise InvalidArgument(name, value, f"a str of 1 to {TEXT_MAX} characters")
    if not value:
        raise InvalidValue(name, value, "must not be empty")
    if len(value) > TEXT_MAX:
        raise InvalidValue(name, value[:60] + "...", f"is longer than {TEXT_MAX} characters ({len(value)})")
    if "\x00" in value:
        raise InvalidValue(name, value, "contains NUL, which Postgres text cannot hold")
    try:
        value.encode("utf-8")  # at most 200 characters: a bounded copy
    except UnicodeEncodeError:  # a lone surrogate (bytes decoded with surrogateescape, say)
        raise InvalidValue(name, value, "is not UTF-8 text") from None
    return value


@dataclass(frozen=True, slots=True)
class InboxResult(Generic[T]):
    first_time: bool  # this call recorded the id and ran the effect
    value: T | None  # what the effect returned (None when it did not run)


def statements(schema: str) -> dict[str, str]:
    q = {
        "claim": sql.SQL("SELECT {}(%s, %s)").format(sql.Identifier(check_identifier(schema, "schema"), "inbox_claim"))
    }
    return {k: v.as_string(None) for k, v in q.items()}


def claim_op(q: dict[str, str], consumer: str, message_id: str, *, last: bool) -> Op[bool]:
    (row,) = yield one(q["claim"], [consumer, message_id], last=last)
    return bool(row[0])


def run_once_op(q: dict[str, str], consumer: str, message_id: str) -> Op[InboxResult[object]]:
    """Claim the id and, only if this call is the first, run the caller's effect, in one savepoint
    of the caller's transaction: if the effect raises, the claim is rolled back with it."""
    first = yield from claim_op(q, consumer, message_id, last=False)
    if not first:
        return InboxResult(False, None)
    value = yield Effect()
    return InboxResult(True, value)


def translate(exc: BaseException) -> BaseException:
    """The typed error of a database error the inbox raises on purpose (SQLSTATE RT009, RT010), or
    `exc` itself. Works for psycopg and asyncpg errors (both carry `sqlstate`)."""
    state = getattr(exc, "sqlstate", None)
    if state == "RT010":
        return IsolationNotSupported("repeatable read")
    if state == "RT009":
        detail = getattr(getattr(exc, "diag", None), "message_detail", None) or getattr(exc, "detail", None)
        return NoInboxPartition(str(detail or "now"))
    return exc


class InboxCore:
    """One consumer's inbox in one schema: configuration and operations; `Inbox` and `AsyncInbox`
    add the faces. `consumer` names the consumer (a group or service): two consumers of one message
    each process it once."""

    def __init__(
        self,
        consumer: str,
        *,
        schema: str = DEFAULT_SCHEMA,
        registry: CollectorRegistry | None = REGISTRY,
        metrics_prefix: str = metrics.DEFAULT_PREFIX,
    ) -> None:
        self.consumer = check_text("consumer", consumer)
        self.schema = check_identifier(schema, "schema")
        self._q = statements(schema)
        self._m: tuple[Counter, Counter] | None = None
        if registry is not None:
            m = metrics.for_registry(registry, metrics_prefix)
            self._m = (
                m.inbox_processed.labels(schema, self.consumer),
                m.inbox_deduplicated.labels(schema, self.consumer),
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.consumer!r}, schema={self.schema!r})"

    def _claim_op(self, message_id: object) -> Op[bool]:
        return claim_op(self._q, self.consumer, check_text("message_id", message_id), last=True)

    def _run_once_op(self, message_id: object) -> Op[InboxResult[object]]:
        return run_once_op(self._q, self.consumer, check_text("message_id", message_id))

    def _count(self, first_time: bool) -> None:
        if self._m:
            self._m[0 if first_time else 1].inc()


__all__ = [
    "TEXT_MAX",
    "InboxCore",
    "InboxError",
    "InboxResult",
    "IsolationNotSupported",
    "NoInboxPartition",
    "check_text",
]
