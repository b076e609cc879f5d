"""Connections that reach Postgres through a transaction pooler (PgBouncer in transaction mode).

Such a pooler hands each client transaction to whichever server connection is free. So nothing may
outlive a transaction on the server side: no named prepared statements (psycopg prepares a query
after `prepare_threshold` runs; PgBouncer before 1.21 forwards none of them to the next server
connection: "prepared statement _pg3_0 does not exist" / "already exists"), no session SET, no
session advisory lock, no LISTEN. The connections this project opens itself detect a pooler and
turn prepared statements off; an application's own connections pass `prepare_threshold=None`.
"""

from __future__ import annotations

import psycopg
from psycopg import pq


def behind_pooler(conn: psycopg.Connection) -> bool:
    """Whether a pooler sits between `conn` and Postgres.

    Postgres announces its backend's process id when a connection starts (BackendKeyData); a
    pooler answers that itself (PgBouncer with a random cancel key), so the id differs from the
    pid of the backend that actually runs our query. One round trip; call it on a fresh connection.
    """
    idle = conn.info.transaction_status == pq.TransactionStatus.IDLE
    row = conn.execute("SELECT pg_backend_pid()", prepare=False).fetchone()
    if idle and not conn.autocommit:
        conn.rollback()  # the probe began a transaction: leave the connection as it was
    return row is not None and row[0] != conn.info.backend_pid


def configure_for_pooler(conn: psycopg.Connection) -> bool:
    """Turn prepared statements off on `conn` if it goes through a pooler; return whether it does."""
    if behind_pooler(conn):
        conn.prepare_threshold = None
        return True
    return False
