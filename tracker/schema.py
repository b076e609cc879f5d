"""Schema names and migrations: the numbered plain-SQL files in sql/, applied in order.

`reaper migrate` calls `migrate()`. The files use unqualified names; each runs with search_path set
to the configured (validated, quoted) schema, so no identifier is ever formatted into SQL raw.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import psycopg
from psycopg import sql

from tracker.errors import InvalidIdentifier

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MIGRATION_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
MIGRATIONS_TABLE = "schema_migrations"
# From this migration on, no function of the schema is executable by PUBLIC (0014_least_privilege).
LEAST_PRIVILEGE_VERSION = 14


def check_identifier(value: object, what: str = "identifier") -> str:
    """Return `value` if it is a plain SQL identifier (quoted afterwards anyway), else raise."""
    if not isinstance(value, str) or not _IDENT.match(value) or len(value.encode()) > 63:
        raise InvalidIdentifier(what, value)
    return value


def qualified(schema: str, table: str) -> sql.Composed:
    return sql.SQL(".").join(
        [sql.Identifier(check_identifier(schema, "schema")), sql.Identifier(check_identifier(table, "table"))]
    )


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()


def _sql_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "sql"
    if here.is_dir():
        return here
    return Path(str(resources.files("tracker._sql")))  # installed from a wheel


def migrations() -> list[Migration]:
    found = []
    for path in sorted(_sql_dir().glob("*.sql")):
        m = _MIGRATION_NAME.match(path.name)
        if not m:
            raise RuntimeError(f"unexpected file in sql/: {path.name} (want NNNN_name.sql)")
        found.append(Migration(int(m.group(1)), path.name, path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration numbers in sql/: {versions}")
    return found


class MigrationDrift(RuntimeError):
    pass


def migration_lock_key(schema: str) -> int:
    # One advisory lock per schema; a stable 63-bit number from its name.
    return int.from_bytes(hashlib.sha256(f"outbox-reaper:migrate:{schema}".encode()).digest()[:8], "big") >> 1


def applied(conn: psycopg.Connection, schema: str) -> dict[int, str]:
    row = conn.execute(
        "SELECT to_regclass(%s)", [f'"{check_identifier(schema, "schema")}".{MIGRATIONS_TABLE}']
    ).fetchone()
    assert row is not None  # a SELECT without FROM returns exactly one row
    if row[0] is None:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT version, checksum FROM {}").format(qualified(schema, MIGRATIONS_TABLE))
    ).fetchall()
    return {v: c for v, c in rows}


def pending_sql(conn: psycopg.Connection, schema: str) -> list[tuple[Migration, str]]:
    """The migrations not yet applied, each with the exact SQL `migrate` would run."""
    done = applied(conn, schema)
    prefix = sql.SQL("SET LOCAL search_path TO {}, public;\n").format(sql.Identifier(schema)).as_string(conn)
    return [(m, prefix + m.text) for m in migrations() if m.version not in done]


def _check_drift(schema: str, wanted: list[Migration], done: dict[int, str]) -> None:
    for m in wanted:
        if m.version in done and done[m.version] != m.checksum:
            raise MigrationDrift(f"migration {m.name} was applied to schema {schema!r} and has since changed")


def migrate(dsn_or_conn: str | psycopg.Connection, schema: str) -> list[str]:
    """Apply pending migrations to `schema`, each in a transaction of its own; return the names applied.

    Every transaction first takes a transaction-level advisory lock on the schema
    (pg_advisory_xact_lock), then re-reads what is applied and checks checksums. A session lock
    would not do: through a transaction pooler (PgBouncer in transaction mode) it stays on whatever
    server connection ran it, and the unlock lands on another. So it is safe to run from several
    processes at once, directly or through PgBouncer: they queue on the lock and the later ones
    find nothing left to do. Raises MigrationDrift if an applied file has since been edited.
    """
    check_identifier(schema, "schema")
    own = isinstance(dsn_or_conn, str)
    conn = (
        psycopg.connect(dsn_or_conn, autocommit=True, prepare_threshold=None)
        if isinstance(dsn_or_conn, str)
        else dsn_or_conn
    )
    if not conn.autocommit:
        raise ValueError("migrate() needs an autocommit connection: each migration commits on its own")
    # The lock and the re-read repeat once per migration: never let psycopg prepare them, since a
    # transaction pooler before PgBouncer 1.21 cannot carry a prepared statement to the next transaction.
    threshold, conn.prepare_threshold = conn.prepare_threshold, None
    try:
        names: list[str] = []
        key, wanted = migration_lock_key(schema), migrations()
        table = qualified(schema, MIGRATIONS_TABLE)
        while True:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [key])
                if not names:
                    # Only when missing: CREATE SCHEMA needs CREATE on the database even when the
                    # schema exists, and an upgrade by the schema's owner must not need it.
                    if conn.execute("SELECT to_regnamespace(%s)", [f'"{schema}"']).fetchone() == (None,):
                        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
                    conn.execute(
                        sql.SQL(
                            "CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, name text NOT NULL, "
                            "checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                        ).format(table)
                    )
                done = applied(conn, schema)
                _check_drift(schema, wanted, done)
                todo = next((m for m in wanted if m.version not in done), None)
                if todo is None:
                    if names and max(done) >= LEAST_PRIVILEGE_VERSION:
                        # PUBLIC's EXECUTE comes back with every new function: taken away after each run
                        conn.execute(
                            sql.SQL("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {} FROM PUBLIC").format(
                                sql.Identifier(schema)
                            )
                        )
                    return names
                conn.execute(sql.SQL("SET LOCAL search_path TO {}, public").format(sql.Identifier(schema)))
                conn.execute(todo.text)
                conn.execute(
                    sql.SQL("INSERT INTO {} (version, name, checksum) VALUES (%s, %s, %s)").format(table),
                    [todo.version, todo.name, todo.checksum],
                )
            names.append(todo.name)
    finally:
        conn.prepare_threshold = threshold
        if own:
            conn.close()
