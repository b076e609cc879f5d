"""What the admin commands share: the typed error they fail with (its exit code is a
harvester.exit_codes.ExitCode), the database connection, and small formatters for their human output."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import psycopg

from harvester.config import Config, redact_dsn
from harvester.dsn_options import dsn_refusal
from harvester.exit_codes import ExitCode
from harvester.startup_checks import missing_table
from tracker.schema import qualified


class AdminError(Exception):
    """A command failed before changing anything; `code` is the process exit code."""

    def __init__(self, message: str, code: ExitCode = ExitCode.FAILURE) -> None:
        super().__init__(message)
        self.code = code


def connect(cfg: Config, dsn: str | None = None) -> psycopg.Connection:
    """A connection in a transaction of its own (not autocommit): each command commits what it
    did as a whole, or rolls all of it back. `dsn`: another database than the `database` section's
    (an outbox entry's)."""
    dsn = cfg.database.dsn if dsn is None else dsn
    try:
        # Never prepared: a command runs each statement a few times at most, and this way it also
        # works through PgBouncer in transaction mode (see the psycopg and PgBouncer how-to).
        return psycopg.connect(dsn, connect_timeout=10, application_name="reaper-admin", prepare_threshold=None)
    except psycopg.Error as exc:
        refused = dsn_refusal(dsn)  # a mistake in the DSN itself: retrying cannot help
        if refused is not None:
            raise AdminError(str(refused), ExitCode.USAGE) from None
        raise AdminError(f"database unreachable: {redact_dsn(str(exc)).strip()}", ExitCode.UNAVAILABLE) from None


def one_row(cursor: psycopg.Cursor[tuple[Any, ...]]) -> tuple[Any, ...]:
    """The single row of a query that always returns one (an aggregate, a RETURNING of one row)."""
    row = cursor.fetchone()
    if row is None:
        raise AdminError("the database returned no row where one was expected", ExitCode.FAILURE)
    return row


def require_tables(conn: psycopg.Connection, schema: str, *tables: str) -> None:
    """Fail clearly (ExitCode.UNAVAILABLE) when the schema lacks a table: not migrated, migrated by an older
    reaper, or an outbox table of the application's own not made yet (startup_checks.missing_table)."""
    names = [qualified(schema, table).as_string(conn) for table in tables]
    found = one_row(
        conn.execute(
            "SELECT array_agg(to_regclass(n) IS NOT NULL ORDER BY i) FROM unnest(%s::text[]) "
            "WITH ORDINALITY AS t(n, i)",
            [names],
        )
    )[0]  # one round trip for all of them
    for table, there in zip(tables, found or [], strict=True):
        if not there:
            conn.rollback()
            raise AdminError(missing_table(schema, table), ExitCode.UNAVAILABLE)


def when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def ago(value: dt.datetime | None, now: dt.datetime) -> str:
    if value is None:
        return ""
    return f" ({duration((now - value).total_seconds())} ago)"


def duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def text_or_hex(data: bytes | None) -> dict[str, str | None]:
    """A key for output: {"text": ...} when it is UTF-8, else {"hex": ...}; None stays None."""
    if data is None:
        return {"text": None}
    try:
        return {"text": bytes(data).decode("utf-8")}
    except UnicodeDecodeError:
        return {"hex": bytes(data).hex()}


def to_json(value: Any) -> str:
    def default(o: Any) -> Any:
        if isinstance(o, dt.datetime):
            return o.isoformat()
        if isinstance(o, (bytes, memoryview)):
            return bytes(o).hex()
        return str(o)

    return json.dumps(value, default=default, indent=2, sort_keys=False)
