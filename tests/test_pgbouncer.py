"""Through the real PgBouncer in transaction pooling mode (deploy/local/services.py): migrations,
the harvester's store, and `reaper run` end to end (harvester + acker + sweeper)."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import psycopg
import pytest

from tracker import schema as schema_mod


def _drop(pg_dsn: str, name: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def _advisory_locks(pg_dsn: str, name: str) -> list[tuple]:
    key = schema_mod._lock_key(name)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory' "
            "AND ((classid::bigint << 32) | objid::bigint) = %s", [key]).fetchall()


def _migrate_procs(dsns: list[str], name: str) -> list[tuple[int, str, str]]:
    procs = []
    for dsn in dsns:
        env = dict(os.environ, REAPER_DATABASE__DSN=dsn, REAPER_DATABASE__SCHEMA=name)
        procs.append(subprocess.Popen([sys.executable, "-m", "harvester.cli", "migrate"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += "\n(timed out: waiting on a lock that was never released?)"
        out.append((p.returncode, stdout, stderr))
    return out


def test_concurrent_reaper_migrate_through_pgbouncer_and_direct(pg_dsn, pgbouncer_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        results = _migrate_procs([pgbouncer_dsn, pg_dsn, pgbouncer_dsn, pg_dsn, pgbouncer_dsn], name)
        assert [rc for rc, _, _ in results] == [0] * 5, results
        names = [m.name for m in schema_mod.migrations()]
        applied = sorted(line.split()[1] for _, out, _ in results for line in out.splitlines()
                         if line.startswith("applied "))
        assert applied == sorted(names), results  # each file applied by exactly one process
        with psycopg.connect(pg_dsn) as conn:
            rows = conn.execute(f'SELECT version FROM "{name}".schema_migrations ORDER BY 1').fetchall()
        assert [r[0] for r in rows] == [m.version for m in schema_mod.migrations()]
        # A transaction-level lock ends with its transaction: nothing is left on a pooled server connection.
        assert _advisory_locks(pg_dsn, name) == []
        again = _migrate_procs([pgbouncer_dsn], name)
        assert again[0][0] == 0 and f"schema {name!r} is up to date (0 applied)" in again[0][1], again
    finally:
        _drop(pg_dsn, name)


def test_migrate_through_pgbouncer_on_a_callers_connection_keeps_its_prepare_threshold(pg_dsn, pgbouncer_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        # The default threshold (5) would have psycopg prepare the per-migration lock statement,
        # which PgBouncer 1.18 cannot carry across transactions; migrate() turns it off while it runs.
        with psycopg.connect(pgbouncer_dsn, autocommit=True) as conn:
            assert schema_mod.migrate(conn, name) == [m.name for m in schema_mod.migrations()]
            assert conn.prepare_threshold == 5
            assert schema_mod.migrate(conn, name) == []
        assert _advisory_locks(pg_dsn, name) == []
    finally:
        _drop(pg_dsn, name)


def test_migrate_through_pgbouncer_still_detects_drift(pg_dsn, pgbouncer_dsn, pgbouncer_schema):
    first = schema_mod.migrations()[0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'UPDATE "{pgbouncer_schema}".schema_migrations SET checksum = %s WHERE version = %s',
                     ["0" * 64, first.version])
    with pytest.raises(schema_mod.MigrationDrift, match=first.name):
        schema_mod.migrate(pgbouncer_dsn, pgbouncer_schema)
    assert _advisory_locks(pg_dsn, pgbouncer_schema) == []

