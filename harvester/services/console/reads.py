"""Statements sent at once, each on its own: one round trip to the database, and one statement's
error (a statement_timeout, a permission, a missing table) is that statement's alone.

psycopg's pipeline sends one Sync at its end, so a failing statement aborts every one queued after
it. Here each statement is followed by its own Sync (libpq's pipeline mode, driven directly): each
runs in its own implicit transaction, and the server goes on with the next after an error. All are
sent before any answer is read.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import ClientCursor, pq
from psycopg.adapt import Transformer

Statement = tuple[Any, Any]  # (query, parameters)


def read_each(conn: psycopg.Connection, statements: list[Statement]) -> list[tuple[Any, ...] | psycopg.Error]:
    """The first row of each statement (an empty tuple: no row), or the error that statement alone
    raised. The connection must be idle (no transaction open); it is left idle."""
    return [got if isinstance(got, psycopg.Error) else (got[0] if got else ()) for got in read_all(conn, statements)]


def read_all(conn: psycopg.Connection, statements: list[Statement]) -> list[list[tuple[Any, ...]] | psycopg.Error]:
    """The rows of each statement, or the error that statement alone raised (as read_each)."""
    if conn.info.transaction_status != pq.TransactionStatus.IDLE:
        raise psycopg.ProgrammingError("read_all needs an idle connection (no transaction open)")
    mogrify = ClientCursor(conn).mogrify  # parameters bound here: one Parse/Bind/Execute each, no types
    queries = [mogrify(q, params).encode(conn.info.encoding) for q, params in statements]
    pg = conn.pgconn
    out: list[list[tuple[Any, ...]] | psycopg.Error] = []
    with conn.lock:
        was_nonblocking = pg.nonblocking
        pg.nonblocking = 0  # blocking sends and reads: the whole exchange happens here
        pg.enter_pipeline_mode()
        try:
            for q in queries:
                pg.send_query_params(q, None)
                pg.pipeline_sync()
            pg.flush()
            for _ in queries:
                out.append(_one(conn, pg))
            pg.exit_pipeline_mode()
            pg.nonblocking = was_nonblocking
        except BaseException:
            pg.finish()  # left mid-exchange (the server gone, an interrupt): no use to anyone now
            raise
    return out


def _one(conn: psycopg.Connection, pg: pq.abc.PGconn) -> list[tuple[Any, ...]] | psycopg.Error:
    """The answer to one statement and its Sync."""
    got: list[tuple[Any, ...]] | psycopg.Error | None = None
    while True:
        res = pg.get_result()
        if res is None:
            if pg.status == pq.ConnStatus.BAD:
                raise psycopg.OperationalError("the connection was lost while reading")
            continue  # the end of one statement's results; its Sync follows
        if res.status == pq.ExecStatus.PIPELINE_SYNC:
            return got if got is not None else []
        if res.status == pq.ExecStatus.TUPLES_OK:
            tx = Transformer(conn)
            tx.set_pgresult(res)
            got = tx.load_rows(0, res.ntuples, tuple)
        elif res.status == pq.ExecStatus.FATAL_ERROR:
            got = psycopg.errors.error_from_result(res, encoding=conn.info.encoding)
