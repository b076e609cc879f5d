"""`reaper migrate --dry-run` prints the script `reaper migrate` would run: a DBA who runs it with psql
instead gets the schema `migrate` makes (the same functions, tables and privileges: EXECUTE taken
from PUBLIC and granted to the app's and reaper's roles; the same records of what was applied; the
namespaces' cutover), from a fresh schema, an older one, or one whose privileges need repair, and
`reaper migrate` then finds nothing to do. A drifted schema fails the dry run as it fails `migrate`."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from support.catalog import catalog_state, normalised
from support.history import files_at
from support.reaper import run_cli
from support.scripts import load_script
from support.teardown import drop_roles, drop_schema

from harvester.exit_codes import ExitCode
from tracker import roles
from tracker import schema as schema_mod

# The last commit whose sql/ held the function bodies in numbered files (as test_migrations).
OLD_CHAIN = "c4a30f3"


def _env(pg_dsn: str, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(REAPER_DATABASE__DSN=pg_dsn, REAPER_DATABASE__SCHEMA=name)
    return env


@pytest.fixture
def schemas(pg_dsn) -> Iterator[list[str]]:
    """Names for schemas of this test, each with its `_app` and `_reaper` roles (so the script's
    grants to them are compared too); all dropped afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        drop_schema(pg_dsn, name)
        drop_roles(pg_dsn, name)


def _new(conn: psycopg.Connection, schemas: list[str]) -> str:
    schemas.append(f"d_{uuid.uuid4().hex[:12]}")
    for r in schema_mod.EVERY_FUNCTION_ROLES:
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(roles.role_name(schemas[-1], r))))
    return schemas[-1]


def _state(conn: psycopg.Connection, schema: str) -> dict[str, list]:
    """The schema's catalog (support.catalog) and what migrate recorded in it."""
    state = catalog_state(conn, schema)
    records = {
        "migrations": "SELECT version, name, checksum FROM {}.schema_migrations ORDER BY 1",
        "definitions": "SELECT name, checksum FROM {}.schema_definitions ORDER BY 1",
        # the cutover: -infinity when the namespace table is new (NO_CUTOVER), else the upgrade's time
        "namespaces": "SELECT outbox, suffix_from = '-infinity' FROM {}.outbox_namespace ORDER BY 1",
    }
    for k, query in records.items():
        rows = conn.execute(sql.SQL(query).format(sql.Identifier(schema))).fetchall()
        state[k] = normalised(schema, rows)
    return state


def _by_old_chain(conn: psycopg.Connection, name: str, tmp: Path) -> None:
    """Migrated by the chain this tree replaced, as that version's `reaper migrate` left it."""
    root = files_at(OLD_CHAIN, ["sql", "tracker/schema.py"], tmp)
    load_script(root / "tracker" / "schema.py", f"old_chain_{name}", register=True).migrate(conn, name)


def _before_the_cutover(conn: psycopg.Connection, name: str, tmp: Path) -> None:
    """Versioned files up to 0019 applied, no definition: the namespace table predates this run."""
    folder = tmp / "sql"
    folder.mkdir()
    for m in schema_mod.migrations():
        if m.version <= 19:
            shutil.copy(Path(schema_mod._sql_dir()) / m.name, folder / m.name)
    schema_mod.migrate(conn, name, folder)


def _with_privileges_undone(conn: psycopg.Connection, name: str, tmp: Path) -> None:
    """Up to date, then PUBLIC given EXECUTE back and the app's role's taken: migrate repairs it."""
    schema_mod.migrate(conn, name)
    s = sql.Identifier(name)
    conn.execute(sql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {} TO PUBLIC").format(s))
    app = sql.Identifier(roles.role_name(name, "app"))
    conn.execute(sql.SQL("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {} FROM {}").format(s, app))


STARTS: dict[str, Callable[[psycopg.Connection, str, Path], None] | None] = {
    "no schema": None,
    "the old chain": _by_old_chain,
    "before the cutover": _before_the_cutover,
    "privileges undone": _with_privileges_undone,
}


@pytest.mark.parametrize("start", list(STARTS))
def test_the_printed_script_run_by_psql_leaves_the_schema_as_migrate_does(pg_dsn, schemas, tmp_path, start):
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        by_script, by_migrate = _new(conn, schemas), _new(conn, schemas)
        prepare = STARTS[start]
        if prepare is not None:
            for i, name in enumerate((by_script, by_migrate)):
                (tmp_path / str(i)).mkdir()
                prepare(conn, name, tmp_path / str(i))

        dry = run_cli(["migrate", "--dry-run"], _env(pg_dsn, by_script))
        assert dry.returncode == ExitCode.OK, dry.stderr
        assert "up to date" not in dry.stdout
        done = subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", pg_dsn, "-f", "-"],
            input=dry.stdout,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        real = run_cli(["migrate"], _env(pg_dsn, by_migrate))
        assert real.returncode == ExitCode.OK, real.stderr

        assert _state(conn, by_script) == _state(conn, by_migrate)
        # PUBLIC executes none of the functions; the roles that run them all, every one
        assert conn.execute(
            "SELECT count(*) FILTER (WHERE has_function_privilege('public', p.oid, 'EXECUTE')),"
            " count(*) FILTER (WHERE NOT has_function_privilege(%s, p.oid, 'EXECUTE'))"
            " FROM pg_proc p WHERE p.pronamespace = %s::regnamespace",
            [roles.role_name(by_script, "reaper"), sql.Identifier(by_script).as_string(conn)],
        ).fetchone() == (0, 0)

    again = run_cli(["migrate"], _env(pg_dsn, by_script))
    assert again.returncode == ExitCode.OK and "(0 applied)" in again.stdout, (again.stdout, again.stderr)
    dry = run_cli(["migrate", "--dry-run"], _env(pg_dsn, by_script))
    assert dry.stdout.strip() == f"-- schema {by_script!r} is up to date", dry.stdout


def test_the_dry_run_of_a_drifted_schema_fails_as_migrate_does(pg_dsn, schema):
    """An applied migration whose file has since changed: neither says the schema is up to date."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.schema_migrations SET checksum = %s WHERE version = 8").format(sql.Identifier(schema)),
            ["0" * 64],
        )
    real = run_cli(["migrate"], _env(pg_dsn, schema))
    dry = run_cli(["migrate", "--dry-run"], _env(pg_dsn, schema))
    for r in (real, dry):
        assert r.returncode == ExitCode.FAILURE, (r.returncode, r.stdout, r.stderr)
        assert "MigrationDrift: migration 0008_ops.sql was applied" in r.stderr, r.stderr
    assert dry.stdout == ""
