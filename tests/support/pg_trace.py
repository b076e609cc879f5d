"""Counting a connection's round trips to Postgres from libpq's protocol trace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psycopg

T = TypeVar("T")


def round_trips(trace: str) -> int:
    """Times the client sent and then waited for the server: frontend messages followed by backend ones."""
    kinds = [line.split("\t", 1)[0] for line in trace.splitlines() if line[:2] in ("F\t", "B\t")]
    return sum(1 for a, b in zip(kinds, kinds[1:], strict=False) if (a, b) == ("F", "B"))


def traced(
    pg_dsn: str, tmp_path: Path, fn: Callable[[psycopg.Connection], T], *, autocommit: bool = False
) -> tuple[T, int]:
    """fn(conn) on a connection of its own, traced: its result and the round trips it took (the
    transaction left idle and the connection usable)."""
    trace = tmp_path / "trace"
    with psycopg.connect(pg_dsn, autocommit=autocommit, prepare_threshold=None) as conn, trace.open("w") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
        got = fn(conn)
        conn.pgconn.untrace()
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.execute("SELECT 7").fetchone() == (7,)  # still usable
    return got, round_trips(trace.read_text())
