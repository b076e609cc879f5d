"""The sync face's driver: runs a core operation's steps on a psycopg `Connection`.

Every call is all or nothing inside the caller's transaction, whatever the connection's mode:

- a transaction is open (autocommit off, or autocommit on inside `conn.transaction()`, nested or
  not, or a SQLAlchemy session/`begin_nested()`): the call runs in a savepoint of it, released on
  success, rolled back to on failure; the caller's transaction is never committed or rolled back;
- autocommit off and nothing open yet: the savepoint's statement begins the caller's transaction
  (as any statement would); the caller commits it;
- autocommit on and no block: there is no caller transaction, so the call is one of its own;
- the caller in pipeline mode: the caller's queued statements are synced first, so the status read
  is true; `Write` steps use INSERT instead of COPY, which libpq refuses in pipeline mode;
- the caller's transaction already failed (in pipeline mode: one of the caller's queued statements
  failed when synced): `CallerTransactionAborted` (the caller's error as its cause), nothing sent.
- interrupted (Ctrl-C, an asyncio cancellation or timeout) while the round carrying the call's start
  or end was on its way, the call cannot know whether the server ran it: it rolls back to its
  savepoint behind a probe savepoint. If the end had run, the savepoint is gone and the call's
  work stands, released into the caller's transaction as a completed statement of the caller's
  would; either way the caller's transaction stays usable and the call raises the interruption.
  Each call's savepoint has a name of its own, so a call nested in another's effect
  (`exactly_once`) never touches the outer call's.

The decision reads the connection's *transaction status*, never `autocommit` alone
(tracker/drivers/calls.py: `boundary`, and the step loop every driver shares). The I/O calls below
are generated from the asyncio driver (tracker/drivers/async_psycopg.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import psycopg
from psycopg import pq
from psycopg.generators import copy_end
from psycopg.rows import tuple_row

from tracker.core.steps import Op, Query, Write
from tracker.drivers.calls import SyncIo, Undo, boundary, drive, frame, inside
from tracker.errors import CallerTransactionAborted

T = TypeVar("T")


def in_pipeline(conn: psycopg.Connection | psycopg.AsyncConnection) -> bool:
    return conn.pgconn.pipeline_status != pq.PipelineStatus.OFF


def usable(conn: psycopg.Connection | psycopg.AsyncConnection) -> bool:
    return not conn.closed and conn.pgconn.status == pq.ConnStatus.OK


def in_transaction(conn: psycopg.Connection | psycopg.AsyncConnection) -> bool:
    return conn.info.transaction_status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)


# <sync psycopg: generated from tracker/drivers/async_psycopg.py by deploy/async_to_sync.py; do not edit>
def _send(conn: psycopg.Connection, queries: Sequence[Query]) -> list[object]:
    if len(queries) == 1 and not in_pipeline(conn):
        cursors = [psycopg.Cursor(conn, row_factory=tuple_row)]
        # A statement without parameters (a call's end, alone) is never prepared: each call's
        # savepoint has a name of its own, so it would only churn the prepared-statement cache.
        prepare = False if queries[0].params is None else None
        cursors[0].execute(queries[0].sql, queries[0].params, prepare=prepare)
    else:
        with conn.pipeline():
            cursors = []
            for q in queries:
                cur = psycopg.Cursor(conn, row_factory=tuple_row)
                # Never prepared inside a pipeline: a statement that fails there skips the Parse of
                # the ones after it, and psycopg could then believe those prepared ("prepared statement
                # _pg3_N does not exist" later, in the caller's transaction).
                cur.execute(q.sql, q.params, prepare=False)
                cursors.append(cur)
    out: list[object] = []
    for q, cur in zip(queries, cursors):
        if q.fetch == "one":
            out.append(cur.fetchone())
        elif q.fetch == "all":
            out.append(cur.fetchall())
        else:
            out.append(None)
    return out


def _write(conn: psycopg.Connection, step: Write) -> None:
    cur = psycopg.Cursor(conn, row_factory=tuple_row)
    if in_pipeline(conn):
        cur.executemany(step.insert_sql, step.rows())
        return
    try:
        with cur.copy(step.copy_sql) as copy:
            for chunk in step.chunks():
                copy.write(chunk)
    except BaseException:
        if conn.pgconn.transaction_status == pq.TransactionStatus.ACTIVE:
            # Interrupted while the COPY began: psycopg read its reply but left the COPY open, the
            # server waiting for data (and every later statement for it). End it as failed, so the
            # call can be undone.
            try:
                conn.wait(copy_end(conn.pgconn, b"interrupted"))
            except psycopg.Error:
                pass  # the failure this asks for
        raise


def _begin(conn: psycopg.Connection, sql: str) -> None:
    psycopg.Cursor(conn).execute(sql, prepare=False)


def _pipelined(conn: psycopg.Connection, statements: Sequence[str]) -> None:
    with conn.pipeline():
        for statement in statements:
            psycopg.Cursor(conn).execute(statement, prepare=False)


def _undo(conn: psycopg.Connection, undo: Undo) -> None:
    """Roll the call back to where it began. An interruption leaves no result pending: psycopg
    reads them all (after asking the server to cancel the statement running), so the connection is
    idle again. In pipeline mode the status is only true once the pipeline has synced (it reads
    ACTIVE while results are pending), so sync first. A savepoint that may be gone (`Undo.unsure`)
    is rolled back to behind a probe, unless the transaction failed inside it (so it is there)."""
    if not usable(conn):
        return
    if in_pipeline(conn):
        try:
            with conn.pipeline():
                pass
        except psycopg.Error:
            pass  # the failure being undone, or one behind it: the status is true now
    if not in_transaction(conn):
        return
    edge = undo.edge
    if not undo.unsure or edge.savepoint is None or conn.info.transaction_status == pq.TransactionStatus.INERROR:
        _pipelined(conn, edge.undo)
        return
    try:
        _pipelined(conn, (edge.probe, *edge.undo))
    except psycopg.errors.InvalidSavepointSpecification:
        # The call's end ran: its work was released into the caller's transaction, and stands.
        _pipelined(conn, edge.unprobe)


_IO: SyncIo[psycopg.Connection] = (_send, _write, _begin, _undo)


def run(
    conn: psycopg.Connection,
    op: Op[T],
    *,
    effect: Callable[[], object] | None = None,
    within: str | None = None,
) -> T:
    """Drive `op` to its result on `conn`, all or nothing inside the caller's transaction (`within`:
    the call's name, when it must not be a transaction of its own: `calls.inside`)."""
    if in_pipeline(conn):
        try:
            with conn.pipeline():  # nested: its exit syncs the caller's queued statements
                pass
        except psycopg.Error as exc:  # one of them failed: the caller's transaction is aborted
            # The status may still read ACTIVE while the pipeline's sync is unread; outside
            # autocommit a server error in the caller's statements has aborted its transaction.
            aborted = conn.info.transaction_status == pq.TransactionStatus.INERROR
            if aborted or (not conn.autocommit and exc.sqlstate is not None):
                raise CallerTransactionAborted() from exc
            raise
    edge = inside(boundary(conn.autocommit, conn.info.transaction_status), within)
    return drive(frame(op, edge), conn, _IO, effect)


# </sync psycopg>
