"""Logouts that hold on every server: the sessions ended by logging out, in the table console_logout.

A session cookie is signed, not stored (harvester.services.console.session), so logging out
records the session (the SHA-256 digest of its id) until the cookie's own expiry, and every
console request checks its session against the table: one primary-key lookup, in one round trip.
Rows past their expiry are deleted by later logouts, a bounded number at a time.
"""

from __future__ import annotations

import datetime as dt
import functools
import hashlib

import psycopg
from psycopg import sql

from tracker.schema import qualified

PRUNE = 100  # expired rows a logout deletes at most


@functools.lru_cache(maxsize=32)
def _statements(schema: str) -> dict[str, sql.Composed]:
    t = qualified(schema, "console_logout")
    return {
        "ended": sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE session = %s)").format(t),
        "record": sql.SQL(
            "INSERT INTO {t} (session, expires_at) VALUES (%s, %s) ON CONFLICT (session) DO NOTHING"
        ).format(t=t),
        "prune": sql.SQL(
            "DELETE FROM {t} WHERE session IN (SELECT session FROM {t} WHERE expires_at < now() LIMIT %s)"
        ).format(t=t),
    }


def _key(session: str) -> bytes:
    return hashlib.sha256(session.encode()).digest()


def ended(conn: psycopg.Connection, schema: str, session: str) -> bool:
    """Whether this session was ended by a logout (read outside a transaction: one round trip)."""
    was = conn.autocommit
    conn.autocommit = True
    try:
        row = conn.execute(_statements(schema)["ended"], [_key(session)]).fetchone()
    finally:
        conn.autocommit = was
    return bool(row and row[0])


def record(conn: psycopg.Connection, schema: str, session: str, expires: float) -> None:
    """End a session on every server until `expires` (unix time: the cookie's own expiry)."""
    q = _statements(schema)
    at = dt.datetime.fromtimestamp(expires, dt.UTC)
    conn.execute(q["record"], [_key(session), at])
    conn.execute(q["prune"], [PRUNE])
    conn.commit()
