"""The caller's connection: a psycopg Connection, or the one behind a SQLAlchemy Session/Connection.

The tracker runs inside the caller's transaction and never commits or rolls it back. `atomic()`
wraps a call's statements in a savepoint so that a call which fails leaves the caller's
transaction usable and exactly as it was.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import psycopg
from psycopg import pq

from .schema import check_identifier


@dataclass
class Defaults:
    schema: str = "reaper"
    completion_topic: str = "batch-completions"
    outbox_table: str = "outbox"


DEFAULTS = Defaults()


def configure(*, schema: str | None = None, completion_topic: str | None = None,
              outbox_table: str | None = None) -> None:
    """Set the process-wide defaults every public function falls back on."""
    if schema is not None:
        DEFAULTS.schema = check_identifier(schema, "schema")
    if completion_topic is not None:
        if not isinstance(completion_topic, str) or not completion_topic:
            raise ValueError(f"completion_topic must be a non-empty string, got {completion_topic!r}")
        DEFAULTS.completion_topic = completion_topic
    if outbox_table is not None:
        DEFAULTS.outbox_table = check_identifier(outbox_table, "outbox table")


def schema_of(schema: str | None) -> str:
    return DEFAULTS.schema if schema is None else check_identifier(schema, "schema")


def pg_connection(session: Any) -> psycopg.Connection:
    """The psycopg connection behind `session` (psycopg Connection, SQLAlchemy Session or Connection)."""
    if isinstance(session, psycopg.Connection):
        return session
    connection = getattr(session, "connection", None)
    if connection is None:
        raise TypeError(f"expected a psycopg Connection or a SQLAlchemy Session/Connection, got {type(session).__name__}")
    # Session.connection() joins (or begins) the session's transaction; Connection.connection is
    # the pool's proxy. Either way the DBAPI connection is the psycopg one.
    proxied = connection() if callable(connection) else connection
    for attr in ("connection", "driver_connection"):  # SQLAlchemy Connection -> pool proxy -> psycopg
        if isinstance(proxied, psycopg.Connection):
            break
        if hasattr(type(proxied), "driver_connection"):
            proxied = proxied.driver_connection
        else:
            proxied = getattr(proxied, attr, proxied)
    if not isinstance(proxied, psycopg.Connection):
        raise TypeError(f"{type(session).__name__} is not backed by psycopg 3 (use a postgresql+psycopg:// engine)")
    return proxied


_SAVEPOINT = "tracker_call"


@contextlib.contextmanager
def atomic(conn: psycopg.Connection) -> Iterator[None]:
    """All or nothing inside the caller's transaction.

    A non-autocommit connection keeps (or implicitly begins) the caller's transaction and gets a
    savepoint in it; the tracker never commits there. An autocommit connection has no caller
    transaction, so the call is its own transaction (psycopg's transaction block).
    """
    if conn.autocommit:
        with conn.transaction():
            yield
        return
    if conn.info.transaction_status == pq.TransactionStatus.INERROR:
        raise psycopg.errors.InFailedSqlTransaction("the caller's transaction is aborted; roll it back first")
    conn.execute("SAVEPOINT " + _SAVEPOINT)  # begins the caller's transaction when none is open
    try:
        yield
    except BaseException:
        if not conn.closed and conn.info.transaction_status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR):
            conn.execute("ROLLBACK TO SAVEPOINT " + _SAVEPOINT)
            conn.execute("RELEASE SAVEPOINT " + _SAVEPOINT)
        raise
    conn.execute("RELEASE SAVEPOINT " + _SAVEPOINT)


@contextlib.contextmanager
def atomic_pipeline(conn: psycopg.Connection) -> Iterator[None]:
    """`atomic()` in pipeline mode: the savepoint (or BEGIN) travels with the first statements and
    its release (or COMMIT) with the last, so a call costs as few round trips as its reads need."""
    if conn.autocommit:
        start, end, undo = "BEGIN", "COMMIT", ["ROLLBACK"]
    else:
        if conn.info.transaction_status == pq.TransactionStatus.INERROR:
            raise psycopg.errors.InFailedSqlTransaction("the caller's transaction is aborted; roll it back first")
        start, end = "SAVEPOINT " + _SAVEPOINT, "RELEASE SAVEPOINT " + _SAVEPOINT
        undo = ["ROLLBACK TO SAVEPOINT " + _SAVEPOINT, "RELEASE SAVEPOINT " + _SAVEPOINT]
    finished = False
    try:
        with conn.pipeline():
            conn.execute(start)
            yield
            conn.execute(end)
        finished = True
    except BaseException:
        if not finished and not conn.closed and conn.info.transaction_status in (
                pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR):
            for statement in undo:
                conn.execute(statement)
        raise
