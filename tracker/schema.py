"""Schema names and migrations: the plain-SQL files in sql/.

Two kinds of file, as Flyway has them:
- versioned migrations, `NNNN_name.sql`: tables, indexes and data, applied once each, in order,
  and checksummed: a changed file that was applied stops `migrate` (MigrationDrift);
- repeatable definitions, `R__name.sql`: every function of the schema, defined once in the tree
  with CREATE OR REPLACE, applied in name order after the versioned migrations whenever their
  text differs from the one last applied (recorded in `schema_definitions`). A function changes by
  editing its definition; no migration copies its body.

A versioned file may be a baseline: lines `-- replaces NNNN_name.sql sha256:<hex>` name the files
it took the place of and the checksum each had. A schema that applied those files is at the
baseline: a replaced file with the same number as the baseline counts as the baseline applied, and
the others are neither run again nor refused (a recorded checksum other than the listed one still
is drift).

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

# Matched whole (fullmatch): `$` would also match before a final newline ("reaper\n", from a
# ConfigMap made from a file), a name that is not the one meant.
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MIGRATION_NAME = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")
_DEFINITION_NAME = re.compile(r"R__[a-z0-9_]+\.sql")
_REPLACES = re.compile(r"^-- replaces (\d{4})_[a-z0-9_]+\.sql sha256:([0-9a-f]{64})$", re.MULTILINE)
MIGRATIONS_TABLE = "schema_migrations"
DEFINITIONS_TABLE = "schema_definitions"
# The roles (tracker.roles) that may execute every function of the schema: `migrate` grants them
# the functions it creates, when they exist, so an upgrade never leaves them without one.
EVERY_FUNCTION_ROLES = ("app", "reaper")
# The message-id namespace table (0017) and the migration giving it the cutover (0022, see
# tracker.message_ids). No earlier version published from a namespace table that did not exist
# before this run: no row needs the short id, so the cutover of its namespaces is -infinity.
NAMESPACE_TABLE, NAMESPACE_MIGRATION, SUFFIX_MIGRATION = "outbox_namespace", 17, 22
NO_CUTOVER = "UPDATE outbox_namespace SET suffix_from = '-infinity'"


MAX_IDENTIFIER_BYTES = 63  # what Postgres keeps of a name (NAMEDATALEN - 1); it cuts longer ones short
# The roles of a schema, `<schema>_<role>` (tracker.roles), and the dead-row table of an outbox table.
ROLES = ("producer", "consumer", "operator", "app", "reaper")
DEAD_TABLE_SUFFIX = "_dead"
# A schema and an outbox table leave room for the names derived from them, which must be identifiers
# too: a name the configuration took must not fail later as a role or a table it never wrote.
MAX_SCHEMA_BYTES = MAX_IDENTIFIER_BYTES - len("_") - max(map(len, ROLES))
MAX_OUTBOX_TABLE_BYTES = MAX_IDENTIFIER_BYTES - len(DEAD_TABLE_SUFFIX)
_ROOM_FOR = {
    "schema": (MAX_SCHEMA_BYTES, "its roles' names (<schema>_consumer)"),
    "outbox table": (MAX_OUTBOX_TABLE_BYTES, f"its dead-row table's name (<table>{DEAD_TABLE_SUFFIX})"),
}


def check_identifier(value: object, what: str = "identifier") -> str:
    """Return `value` if it is a plain SQL identifier (quoted afterwards anyway), else raise
    InvalidIdentifier naming `what` and the value. A "schema" (MAX_SCHEMA_BYTES) and an "outbox
    table" (MAX_OUTBOX_TABLE_BYTES) are shorter still: their roles' and dead-row table's names fit."""
    max_bytes, room_for = _ROOM_FOR.get(what, (MAX_IDENTIFIER_BYTES, ""))
    if not isinstance(value, str) or not _IDENT.fullmatch(value):
        raise InvalidIdentifier(what, value, max_bytes=max_bytes)
    if len(value.encode()) > max_bytes:
        raise InvalidIdentifier(what, value, max_bytes=max_bytes, room_for=room_for)
    return value


def role_name(schema: str, role: str) -> str:
    """The NOLOGIN role `<schema>_<role>` (tracker.roles)."""
    return check_identifier(f"{check_identifier(schema, 'schema')}_{role}", "role name")


def qualified(schema: str, table: str) -> sql.Composed:
    return sql.SQL(".").join(
        [sql.Identifier(check_identifier(schema, "schema")), sql.Identifier(check_identifier(table, "table"))]
    )


# The tables the reaper's commands ask for that `reaper migrate` makes; any other one the
# configuration names (database.outbox_table, an outbox entry's table, and its `_dead` table) is
# the application's own, which migrating cannot make.
MIGRATED_TABLES = frozenset({"outbox", "outbox_dead", "batch", "batch_group", "admin_log", "inbox", "inbox_partition"})


def _written(name: str) -> str:
    # as SQL needs it written: a name with capitals quoted (names are checked identifiers)
    return name if name == name.lower() else f'"{name}"'


def missing_table(schema: str, table: str) -> str:
    """What to say of a table `schema`.`table` that does not exist: what would make it."""
    if table in MIGRATED_TABLES:
        return f"table {schema}.{table} does not exist: run `reaper migrate`"
    dead = table.endswith(DEAD_TABLE_SUFFIX)
    like = "outbox_dead" if dead else "outbox"
    what = "the configured outbox table's dead-row table" if dead else "the configured outbox table"
    s, t = _written(schema), _written(table)
    return (
        f"table {schema}.{table} does not exist: {what} is the application's own, which `reaper migrate` does "
        f"not make (it makes {schema}.{like}); create it with the same columns: CREATE TABLE {s}.{t} "
        f'(LIKE {s}.{like} INCLUDING ALL) (see docs/howto/running.md, "Spread the harvest: units and lanes")'
    )


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def replaces(self) -> dict[int, str]:
        """The files this baseline took the place of: version -> the checksum it had."""
        return {int(v): c for v, c in _REPLACES.findall(self.text)}


@dataclass(frozen=True)
class Definition:
    """A repeatable definition (R__name.sql): applied again whenever its text changes."""

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


def _files(directory: Path | None) -> list[Path]:
    paths = sorted((directory or _sql_dir()).glob("*.sql"))
    for path in paths:
        if not (_MIGRATION_NAME.fullmatch(path.name) or _DEFINITION_NAME.fullmatch(path.name)):
            raise RuntimeError(f"unexpected file in sql/: {path.name} (want NNNN_name.sql or R__name.sql)")
    return paths


def migrations(directory: Path | None = None) -> list[Migration]:
    """The versioned migrations, in order (`directory`: another sql/ folder than this installation's)."""
    found = []
    for path in _files(directory):
        named = _MIGRATION_NAME.fullmatch(path.name)
        if named:
            found.append(Migration(int(named.group(1)), path.name, path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration numbers in sql/: {versions}")
    for baseline in found:
        taken = (set(baseline.replaces) - {baseline.version}) & set(versions)
        if taken:
            raise RuntimeError(f"{baseline.name} replaces migrations still in sql/: {sorted(taken)}")
    replaced = [v for b in found for v in b.replaces]
    if len(set(replaced)) != len(replaced):
        raise RuntimeError(f"a migration is replaced by two baselines in sql/: {replaced}")
    return found


def definitions(directory: Path | None = None) -> list[Definition]:
    """The repeatable definitions, in the order they are applied (by name)."""
    return [Definition(p.name, p.read_text()) for p in _files(directory) if _DEFINITION_NAME.fullmatch(p.name)]


class MigrationDrift(RuntimeError):
    pass


def migration_lock_key(schema: str) -> int:
    # One advisory lock per schema; a stable 63-bit number from its name.
    return int.from_bytes(hashlib.sha256(f"outbox-reaper:migrate:{schema}".encode()).digest()[:8], "big") >> 1


def _recorded(conn: psycopg.Connection, schema: str, table: str, key: str) -> dict:
    row = conn.execute("SELECT to_regclass(%s)", [f'"{check_identifier(schema, "schema")}".{table}']).fetchone()
    assert row is not None  # a SELECT without FROM returns exactly one row
    if row[0] is None:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT {}, checksum FROM {}").format(sql.Identifier(key), qualified(schema, table))
    ).fetchall()
    return {k: c for k, c in rows}


def applied(conn: psycopg.Connection, schema: str) -> dict[int, str]:
    """The versioned migrations recorded as applied: version -> checksum."""
    return _recorded(conn, schema, MIGRATIONS_TABLE, "version")


def applied_definitions(conn: psycopg.Connection, schema: str) -> dict[str, str]:
    """The repeatable definitions recorded as applied: name -> checksum of the text applied last."""
    return _recorded(conn, schema, DEFINITIONS_TABLE, "name")


def _path(conn: psycopg.Connection, schema: str, item: Migration | Definition) -> str:
    # Definitions keep this path (SET search_path FROM CURRENT): the schema, pg_catalog, then pg_temp
    # LAST, so that a caller's temporary table named like ours can never stand in for it.
    tail = "public" if isinstance(item, Migration) else "pg_catalog, pg_temp"
    return sql.SQL("SET LOCAL search_path TO {}, " + tail).format(sql.Identifier(schema)).as_string(conn)


def pending_sql(conn: psycopg.Connection, schema: str) -> list[str]:
    """The transactions `migrate` would run now, in order, each a whole `BEGIN; ... COMMIT;` text
    headed by a comment naming what it applies: each migration in one of its own, then every changed
    definition together, each under the schema's advisory lock, with the rows that record them, the
    namespaces' cutover (NO_CUTOVER) and EXECUTE taken from PUBLIC and granted to the roles that exist
    now (`_privileges`); none when nothing is to do. Run in order (`psql -v ON_ERROR_STOP=1`), they
    leave the schema as `migrate` would. Raises MigrationDrift as `migrate` does."""
    check_identifier(schema, "schema")
    wanted, done, defined = migrations(), applied(conn, schema), applied_definitions(conn, schema)
    _check_drift(schema, wanted, done)
    todo: list[list[Migration] | list[Definition]] = [[m] for m in wanted if m.version not in done]
    changed = [d for d in definitions() if defined.get(d.name) != d.checksum]
    if changed:
        todo.append(changed)
    # migrate() decides it when it reaches the namespace table's migration: did the table exist before?
    fresh = NAMESPACE_MIGRATION not in done and conn.execute(
        "SELECT to_regclass(%s) IS NULL", [qualified(schema, NAMESPACE_TABLE).as_string(conn)]
    ).fetchone() == (True,)
    # With nothing to apply, migrate still repairs the functions' privileges when they need it.
    privileges = _privileges_sql(conn, schema, only_if_needed=not todo)
    if not todo and not privileges:
        return []
    lock = sql.SQL("SELECT pg_advisory_xact_lock({})").format(sql.Literal(migration_lock_key(schema)))
    first = [lock, *_bookkeeping_sql(conn, schema)]
    scripts: list[str] = []
    for items in todo or [[]]:
        lines = [_heading(items), "BEGIN;", *(f"{s.as_string(conn)};" for s in (first if not scripts else [lock]))]
        for item in items:
            if isinstance(item, Definition):
                lines.append(f"-- {item.name}")
            lines += [f"{_path(conn, schema, item)};", item.text.rstrip()]
            if isinstance(item, Migration) and item.version == SUFFIX_MIGRATION and fresh:
                lines.append(f"{NO_CUTOVER};")
            lines.append(f"{_record_sql(schema, item).as_string(conn)};")
        lines += [f"{s.as_string(conn)};" for s in privileges]
        scripts.append("\n".join([*lines, "COMMIT;", ""]))
    return scripts


def _heading(items: list[Migration] | list[Definition]) -> str:
    if not items:
        return "-- EXECUTE on the schema's functions: taken from PUBLIC, granted to the roles that run them all"
    if isinstance(items[0], Migration):
        return f"-- {items[0].name}"
    return "-- the changed definitions, in one transaction"


def _record_sql(schema: str, item: Migration | Definition) -> sql.Composed:
    """The row `migrate` writes in the transaction that applies `item`."""
    if isinstance(item, Migration):
        return sql.SQL("INSERT INTO {} (version, name, checksum) VALUES ({}, {}, {})").format(
            qualified(schema, MIGRATIONS_TABLE),
            sql.Literal(item.version),
            sql.Literal(item.name),
            sql.Literal(item.checksum),
        )
    return sql.SQL(
        "INSERT INTO {} (name, checksum) VALUES ({}, {}) "
        "ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()"
    ).format(qualified(schema, DEFINITIONS_TABLE), sql.Literal(item.name), sql.Literal(item.checksum))


def _check_drift(schema: str, wanted: list[Migration], done: dict[int, str]) -> None:
    for m in wanted:
        if m.version in done and done[m.version] not in {m.checksum, m.replaces.get(m.version)}:
            raise MigrationDrift(f"migration {m.name} was applied to schema {schema!r} and has since changed")
        for version, checksum in m.replaces.items():
            if version != m.version and version in done and done[version] != checksum:
                raise MigrationDrift(
                    f"migration {version:04d} applied to schema {schema!r} is not the one baseline {m.name} replaces"
                )


def _bookkeeping(conn: psycopg.Connection, schema: str) -> None:
    """The schema and the two record tables, created when missing (inside the lock)."""
    for statement in _bookkeeping_sql(conn, schema):
        conn.execute(statement)


def _bookkeeping_sql(conn: psycopg.Connection, schema: str) -> list[sql.Composed]:
    # The schema only when missing: CREATE SCHEMA needs CREATE on the database even when the schema
    # exists, and an upgrade by the schema's owner must not need it.
    missing = conn.execute("SELECT to_regnamespace(%s)", [f'"{schema}"']).fetchone() == (None,)
    return [
        *([sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema))] if missing else []),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (version integer PRIMARY KEY, name text NOT NULL, "
            "checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(qualified(schema, MIGRATIONS_TABLE)),
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (name text PRIMARY KEY, checksum text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        ).format(qualified(schema, DEFINITIONS_TABLE)),
    ]


def _next(
    conn: psycopg.Connection, schema: str, wanted: list[Migration], defs: list[Definition]
) -> Migration | list[Definition]:
    """What to apply next: the first versioned migration not applied, else every definition whose
    text is not the one applied last (all of them together: one may call another's function, so
    the schema never shows some new definitions without the others)."""
    done = applied(conn, schema)
    _check_drift(schema, wanted, done)
    todo = next((m for m in wanted if m.version not in done), None)
    if todo is not None:
        return todo
    defined = applied_definitions(conn, schema)
    return [d for d in defs if defined.get(d.name) != d.checksum]


def _privileges(conn: psycopg.Connection, schema: str, *, only_if_needed: bool = False) -> None:
    for statement in _privileges_sql(conn, schema, only_if_needed=only_if_needed):
        conn.execute(statement)


def _privileges_sql(conn: psycopg.Connection, schema: str, *, only_if_needed: bool = False) -> list[sql.Composed]:
    # PUBLIC's EXECUTE comes back with every new function: taken away in the transaction that made
    # it (a per-schema default privilege would not do it). The roles that run every function get
    # the new ones. only_if_needed: change nothing (no catalog write) when that holds already.
    s = sql.Identifier(schema)
    names = [role_name(schema, r) for r in EVERY_FUNCTION_ROLES]
    roles = [r for (r,) in conn.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s) ORDER BY 1", [names])]
    if only_if_needed:
        row = conn.execute(
            "SELECT EXISTS (SELECT FROM pg_proc p WHERE p.pronamespace = %s::regnamespace"
            " AND (has_function_privilege('public', p.oid, 'EXECUTE')"
            " OR EXISTS (SELECT FROM unnest(%s::text[]) r WHERE NOT has_function_privilege(r, p.oid, 'EXECUTE'))))",
            [f'"{schema}"', roles],
        ).fetchone()
        if row == (False,):
            return []
    return [
        sql.SQL("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {} FROM PUBLIC").format(s),
        *(sql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {} TO {}").format(s, sql.Identifier(r)) for r in roles),
    ]


def migrate(dsn_or_conn: str | psycopg.Connection, schema: str, directory: Path | None = None) -> list[str]:
    """Apply pending migrations to `schema`, each in a transaction of its own, then the changed
    definitions, all in one transaction; return the names applied. Every transaction also takes
    EXECUTE on the schema's functions from PUBLIC and grants it to the app's and reaper's roles.

    Every transaction first takes a transaction-level advisory lock on the schema
    (pg_advisory_xact_lock), then re-reads what is applied and checks checksums. A session lock
    would not do: through a transaction pooler (PgBouncer in transaction mode) it stays on whatever
    server connection ran it, and the unlock lands on another. So it is safe to run from several
    processes at once, directly or through PgBouncer: they queue on the lock and the later ones
    find nothing left to do. Raises MigrationDrift if an applied file has since been edited.
    `directory`: another sql/ folder than this installation's.
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
        fresh = False  # this run created the namespace table (see NO_CUTOVER)
        key, wanted, defs = migration_lock_key(schema), migrations(directory), definitions(directory)
        while True:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [key])
                if not names:
                    _bookkeeping(conn, schema)
                todo = _next(conn, schema, wanted, defs)
                items = [todo] if isinstance(todo, Migration) else todo
                for item in items:
                    conn.execute(_path(conn, schema, item))
                    version = item.version if isinstance(item, Migration) else None
                    if version == NAMESPACE_MIGRATION:
                        fresh = conn.execute(
                            "SELECT to_regclass(%s) IS NULL", [qualified(schema, NAMESPACE_TABLE).as_string(conn)]
                        ).fetchone() == (True,)
                    conn.execute(item.text)
                    if version == SUFFIX_MIGRATION and fresh:
                        conn.execute(NO_CUTOVER)
                    if isinstance(item, Migration):
                        conn.execute(
                            sql.SQL("INSERT INTO {} (version, name, checksum) VALUES (%s, %s, %s)").format(
                                qualified(schema, MIGRATIONS_TABLE)
                            ),
                            [item.version, item.name, item.checksum],
                        )
                    else:
                        conn.execute(
                            sql.SQL(
                                "INSERT INTO {} (name, checksum) VALUES (%s, %s) "
                                "ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()"
                            ).format(qualified(schema, DEFINITIONS_TABLE)),
                            [item.name, item.checksum],
                        )
                # In the same transaction as what it applied (a kill between the two would leave
                # PUBLIC its EXECUTE), and on every run (repairing one that died before this line).
                _privileges(conn, schema, only_if_needed=not items)
                if not items:
                    return names
            names.extend(item.name for item in items)
    finally:
        conn.prepare_threshold = threshold
        if own:
            conn.close()
