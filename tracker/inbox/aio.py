"""The inbox's asyncio face: `AsyncInbox`, the same API as `tracker.inbox.Inbox` with `await`, on
every connection the asyncio tracker takes (tracker.aio): a psycopg `AsyncConnection`, an asyncpg
`Connection`, or a SQLAlchemy `AsyncSession`/`AsyncConnection`.

    from tracker.inbox import aio as inbox

    async def handle(session: AsyncSession, message_id: str, order: dict) -> None:
        done = await inbox.run_once(session, message_id, lambda s: book(s, order), consumer="billing")
        await session.commit()  # the effect and the id commit together

The region marked below is also the sync face (tracker/inbox/sync.py, generated from it by
deploy/async_to_sync.py).
"""

from __future__ import annotations

import functools
from typing import TypeVar

from tracker.aio import AsyncEffect, _effect_call, _run
from tracker.config import DEFAULT_SCHEMA
from tracker.drivers.connections import AsyncSession
from tracker.inbox.core import InboxCore, InboxResult, check_text, translate
from tracker.schema import check_identifier

T = TypeVar("T")


# <async inbox>
class AsyncInbox(InboxCore):
    """One consumer's inbox (`consumer`: its name; two consumers of a message each process it
    once) in one schema. Holds no connection: one inbox serves every session (and thread)."""

    async def claim(self, session: AsyncSession, message_id: str | bytes) -> bool:
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
            first = await _run(session, op, within="an inbox claim")
        except Exception as exc:
            typed = translate(exc)
            if typed is exc:
                raise
            raise typed from exc
        self._count(first)
        return first

    async def run_once(self, session: AsyncSession, message_id: str | bytes, effect: AsyncEffect[T]) -> InboxResult[T]:
        """Claim `message_id` and, only if this call is the first, run `effect(session)`, all in
        one savepoint of the caller's transaction: the id and the effect commit or roll back
        together, so a redelivery, a concurrent duplicate or a retry after a crash before the
        commit runs the effect exactly once. Returns first_time=False (and does not call `effect`)
        for a duplicate. If the effect raises, the claim is rolled back with it and the error
        propagates: the message is still unprocessed. On the asyncio face `effect` may be a
        coroutine function."""
        op = self._run_once_op(message_id)
        try:
            result = await _run(session, op, effect=_effect_call(effect, session))
        except Exception as exc:
            typed = translate(exc)
            if typed is exc:
                raise
            raise typed from exc
        self._count(result.first_time)
        return result  # type: ignore[return-value]


def default(consumer: str, schema: str | None = None) -> AsyncInbox:
    """The AsyncInbox of `consumer` in `schema` (default "reaper") that the module-level functions use."""
    # Checked before the cache, which would hash whatever it is given (a list: a bare TypeError).
    return _default(
        check_text("consumer", consumer), DEFAULT_SCHEMA if schema is None else check_identifier(schema, "schema")
    )


@functools.lru_cache(maxsize=64)
def _default(consumer: str, schema: str) -> AsyncInbox:
    return AsyncInbox(consumer, schema=schema)


async def claim(session: AsyncSession, message_id: str | bytes, *, consumer: str, schema: str | None = None) -> bool:
    """`AsyncInbox.claim` on the inbox of `consumer` in `schema`."""
    return await default(consumer, schema).claim(session, message_id)


async def run_once(
    session: AsyncSession,
    message_id: str | bytes,
    effect: AsyncEffect[T],
    *,
    consumer: str,
    schema: str | None = None,
) -> InboxResult[T]:
    """`AsyncInbox.run_once` on the inbox of `consumer` in `schema`."""
    return await default(consumer, schema).run_once(session, message_id, effect)


# </async inbox>

__all__ = ["AsyncInbox", "InboxResult", "claim", "default", "run_once"]
