"""What a failed test leaves behind must not stop the suite.

A test that fails while one of its connections holds locks in a transaction (a batch row held to
make another writer wait, say) keeps that connection open: its traceback, kept by the report and by
`sys.last_traceback`, holds the test's frames and so the connection. The schema's teardown then
waits on those locks for ever, and every other worker behind it too, since a migration's CREATE
INDEX CONCURRENTLY waits for every older transaction in the database. Two defences:

- `release_failed_frames` (a pytest_runtest_makereport hook, imported by conftest): once the
  report of a failed setup or call is written, the frames of its traceback are cleared, so what
  only they held (connections, clients, threads' handles) is let go before the teardown.
- `drop_schema`: DROP SCHEMA with a short lock wait; connections still holding locks in the schema
  after it are ended and the drop tried again, a few times, then an error that names them.
"""

from __future__ import annotations

import gc
from collections.abc import Generator

import psycopg
import pytest
from psycopg import sql

LOCK_WAIT = "5s"
TRIES = 4

_HOLDERS = """
SELECT l.pid, pg_terminate_backend(l.pid)
FROM pg_locks l JOIN pg_class c ON c.oid = l.relation JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND l.granted AND l.pid <> pg_backend_pid()
GROUP BY l.pid
"""


class SchemaNotDropped(RuntimeError):
    pass


def drop_schema(dsn: str, name: str, *, if_exists: bool = True) -> None:
    """DROP SCHEMA `name` CASCADE, ending the connections that hold locks in it if they make the
    drop wait longer than LOCK_WAIT."""
    drop = sql.SQL("DROP SCHEMA {}{} CASCADE").format(sql.SQL("IF EXISTS " if if_exists else ""), sql.Identifier(name))
    ended: list[int] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(LOCK_WAIT)))
        for _ in range(TRIES):
            try:
                conn.execute(drop)
                return
            except psycopg.errors.LockNotAvailable:
                ended += [pid for pid, _ in conn.execute(_HOLDERS, [name]).fetchall()]
    raise SchemaNotDropped(f"schema {name} still locked after ending backends {ended}")


def drop_role(conn: psycopg.Connection, role: str) -> None:
    """DROP OWNED BY and DROP ROLE `role`, if it exists (roles are the cluster's, not a schema's)."""
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [role]).fetchone():
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def drop_roles(dsn: str, schema: str) -> None:
    """drop_role for each of the schema's roles (tracker.roles) that exists."""
    from tracker import roles

    with psycopg.connect(dsn, autocommit=True) as conn:
        for r in roles.ROLES:
            drop_role(conn, roles.role_name(schema, r))


@pytest.hookimpl(wrapper=True)
def release_failed_frames(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport]:
    report = yield
    excinfo = call.excinfo
    if excinfo is not None and call.when != "teardown" and not item.config.getoption("usepdb", False):
        try:  # (--pdb needs the frames after the report)
            _clear(excinfo.value)
            gc.collect()  # what the frames held may sit in reference cycles (psycopg's connections do)
        except Exception as exc:  # a defence of the suite's must never break the run itself
            item.warn(pytest.PytestWarning(f"the failed test's frames were not released: {exc!r}"))
    return report


def _clear(error: BaseException) -> None:
    """Clear the frames of `error`'s traceback and of every exception chained to it or grouped in it."""
    seen: set[int] = set()
    todo = [error]
    while todo:
        exc = todo.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            # Before Python 3.13 the report's reading of f_locals left a snapshot dict that outlives
            # frame.clear(): it is emptied too, unless it is a module's namespace (a module frame's
            # f_locals is its globals). From 3.13 f_locals is a view, and clear() is enough.
            snapshot = frame.f_locals
            if type(snapshot) is dict and snapshot is not frame.f_globals:
                snapshot.clear()
            try:
                frame.clear()
            except RuntimeError:
                pass  # still executing: not ours to clear
            tb = tb.tb_next
        todo += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        todo += list(getattr(exc, "exceptions", ()))  # an exception group's members
