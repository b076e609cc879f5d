"""The inbox's sync face: `Inbox`, on every connection the sync tracker takes (tracker.sync): a
psycopg `Connection` (any mode, pipelines too) or a SQLAlchemy `Session`/`Connection`.

The region marked below is generated from the asyncio face (tracker/inbox/aio.py) by
deploy/async_to_sync.py: edit it there.
"""

from __future__ import annotations

import functools
from typing import TypeVar

from tracker.config import DEFAULT_SCHEMA
from tracker.drivers.connections import SyncSession
from tracker.inbox.core import InboxCore, InboxResult, check_text, translate
from tracker.schema import check_identifier
from tracker.sync import SyncEffect, _effect_call, _run

T = TypeVar("T")


# <sync inbox: generated from tracker/inbox/aio.py by deploy/async_to_sync.py; do not edit>
class Inbox(InboxCore):
    """One consumer's inbox (`consumer`: its name; two consumers of a message each process it
    once) in one schema. Holds no connection: one inbox serves every session (and thread)."""

    def claim(self, session: SyncSession, message_id: str | bytes) -> bool:
        """Record `message_id` as processed by this consumer, in the caller's transaction: True if
        this call recorded it (go on with the effect, in the same transaction), False if it was
        recorded already (a duplicate: do nothing). A concurrent claim of the same id by another
        transaction waits until that one ends, then returns False if it committed.

        Raises InvalidArgument / InvalidValue (an id that is not 1 to 200 characters, naming it),
        NoCallerTransaction (no transaction open: autocommit with no block, asyncpg outside one;
        `run_once` takes the effect into the claim's transaction there), IsolationNotSupported
        (REPEATABLE READ) or NoInboxPartition; then nothing was recorded and
        the caller's transaction is as it was."""
        op = self._claim_op(message_id)
        try:
            # Alone in a transaction of its own, the claim would commit before the effect ran.
            first = _run(session, op, within="an inbox claim")
        except Exception as exc:
            typed = translate(exc)
            if typed is exc:
                raise
            raise typed from exc
        self._count(first)
        return first

    def run_once(self, session: SyncSession, message_id: str | bytes, effect: SyncEffect[T]) -> InboxResult[T]:
        """Claim `message_id` and, only if this call is the first, run `effect(session)`, all in
        one savepoint of the caller's transaction: the id and the effect commit or roll back
        together, so a redelivery, a concurrent duplicate or a retry after a crash before the
        commit runs the effect exactly once. Returns first_time=False (and does not call `effect`)
        for a duplicate. If the effect raises, the claim is rolled back with it and the error
        propagates: the message is still unprocessed. On the asyncio face `effect` may be a
        coroutine function."""
        op = self._run_once_op(message_id)
        try:
            result = _run(session, op, effect=_effect_call(effect, session))
        except Exception as exc:
            typed = translate(exc)
            if typed is exc:
                raise
            raise typed from exc
        self._count(result.first_time)
        return result  # type: ignore[return-value]


def default(consumer: str, schema: str | None = None) -> Inbox:
    """The Inbox of `consumer` in `schema` (default "reaper") that the module-level functions use."""
    # Checked before the cache, which would hash whatever it is given (a list: a bare TypeError).
    return _default(
        check_text("consumer", consumer), DEFAULT_SCHEMA if schema is None else check_identifier(schema, "schema")
    )


@functools.lru_cache(maxsize=64)
def _default(consumer: str, schema: str) -> Inbox:
    return Inbox(consumer, schema=schema)


def claim(session: SyncSession, message_id: str | bytes, *, consumer: str, schema: str | None = None) -> bool:
    """`Inbox.claim` on the inbox of `consumer` in `schema`."""
    return default(consumer, schema).claim(session, message_id)


def run_once(
    session: SyncSession,
    message_id: str | bytes,
    effect: SyncEffect[T],
    *,
    consumer: str,
    schema: str | None = None,
) -> InboxResult[T]:
    """`Inbox.run_once` on the inbox of `consumer` in `schema`."""
    return default(consumer, schema).run_once(session, message_id, effect)


# </sync inbox>

__all__ = ["Inbox", "InboxResult", "claim", "default", "run_once"]
