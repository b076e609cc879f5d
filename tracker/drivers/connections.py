"""The caller's connection: which psycopg connection a `session` argument stands for.

Sync face: a psycopg `Connection`, or the one behind a SQLAlchemy `Session` or `Connection` on the
psycopg driver. Asyncio face: a psycopg `AsyncConnection`, or the one behind a SQLAlchemy
`AsyncSession` or `AsyncConnection` on the psycopg driver. Anything else is refused with
`UnsupportedConnection`, which names what is supported. Resolving never commits: SQLAlchemy's
`Session.connection()` joins (or begins) the session's own transaction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import psycopg

from tracker.errors import UnsupportedConnection

if TYPE_CHECKING:
    import asyncpg
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession as SAAsyncSession
    from sqlalchemy.orm import Session as SASession

# What each face accepts (SQLAlchemy objects on the psycopg driver); anything else is refused with
# an error naming these.
SyncSession = Union[psycopg.Connection, "SASession", "SAConnection"]
AsyncSession = Union[psycopg.AsyncConnection, "asyncpg.Connection", "SAAsyncSession", "SAAsyncConnection"]


def _driver_name(sa_connection: object) -> str | None:
    dialect = getattr(sa_connection, "dialect", None)
    return getattr(dialect, "driver", None)


def sync_connection(session: object) -> psycopg.Connection:
    """The psycopg Connection behind `session`."""
    if isinstance(session, psycopg.Connection):
        return session
    if isinstance(session, psycopg.AsyncConnection):
        raise UnsupportedConnection(session, "sync", "an AsyncConnection belongs to the asyncio face: use tracker.aio")
    module = type(session).__module__
    if module.startswith("sqlalchemy.ext.asyncio"):
        raise UnsupportedConnection(session, "sync", "an asyncio session belongs to the asyncio face: use tracker.aio")
    if not module.startswith("sqlalchemy"):
        raise UnsupportedConnection(session, "sync")
    attr = getattr(session, "connection", None)
    sa_connection = attr() if callable(attr) else attr  # Session.connection() / Connection itself
    if module.startswith("sqlalchemy.engine"):
        sa_connection = session
    driver = _driver_name(sa_connection)
    if driver != "psycopg":
        raise UnsupportedConnection(session, "sync", f"its engine uses the {driver!r} driver")
    raw = sa_connection.connection.driver_connection  # type: ignore[union-attr]
    if not isinstance(raw, psycopg.Connection):
        raise UnsupportedConnection(session, "sync", f"its driver connection is a {type(raw).__name__}")
    return raw


def _is_asyncpg(conn: object) -> bool:
    """An asyncpg Connection (an application's subclass too: asyncpg.connect(connection_class=...))
    or a pool's proxy of one."""
    return any(c.__module__.startswith("asyncpg") for c in type(conn).__mro__[:-1]) and hasattr(
        conn, "is_in_transaction"
    )


async def async_connection(session: object) -> psycopg.AsyncConnection | asyncpg.Connection:
    """The driver connection behind `session`: a psycopg AsyncConnection or an asyncpg Connection."""
    if isinstance(session, psycopg.AsyncConnection) or _is_asyncpg(session):
        return session
    if isinstance(session, psycopg.Connection):
        raise UnsupportedConnection(session, "async", "a sync Connection belongs to the sync face: use tracker")
    module = type(session).__module__
    if not module.startswith("sqlalchemy.ext.asyncio"):
        why = (
            "a sync SQLAlchemy session belongs to the sync face: use tracker" if module.startswith("sqlalchemy") else ""
        )
        raise UnsupportedConnection(session, "async", why)
    sa_connection = session
    if hasattr(session, "sync_session"):  # AsyncSession: join or begin its transaction
        sa_connection = await session.connection()  # type: ignore[attr-defined]
    driver = _driver_name(sa_connection.sync_connection)  # type: ignore[attr-defined]
    if driver not in ("psycopg", "asyncpg"):
        raise UnsupportedConnection(session, "async", f"its engine uses the {driver!r} driver")
    fairy = await sa_connection.get_raw_connection()  # type: ignore[attr-defined]
    raw = fairy.driver_connection
    if driver == "asyncpg" and _is_asyncpg(raw):
        if not raw.is_in_transaction() and sa_connection.in_transaction():  # type: ignore[attr-defined]
            # SQLAlchemy's asyncpg adapter opens its transaction at the first statement: make it
            # open now, or the call would run (and commit) outside the session's transaction.
            await sa_connection.exec_driver_sql("SELECT 1")  # type: ignore[attr-defined]
        return raw
    if not isinstance(raw, psycopg.AsyncConnection):
        raise UnsupportedConnection(session, "async", f"its driver connection is a {type(raw).__name__}")
    return raw
