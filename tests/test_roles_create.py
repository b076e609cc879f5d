"""`reaper migrate --roles create|print` (tracker.roles.create and script): safe to run from several
processes at once, as `reaper migrate` is, and right for a schema whose name has capitals."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from support.reaper import run_cli
from support.teardown import drop_roles, drop_schema

from harvester.exit_codes import ExitCode
from tracker import roles
from tracker.schema import migrate


@pytest.fixture
def migrated(pg_dsn: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated schema named `<param><hex>` (its roles and itself dropped afterwards)."""
    name = f"{getattr(request, 'param', 'rc_')}{uuid.uuid4().hex[:10]}"
    migrate(pg_dsn, name)
    try:
        yield name
    finally:
        drop_schema(pg_dsn, name)
        drop_roles(pg_dsn, name)


def test_roles_created_by_several_processes_at_once_all_succeed(pg_dsn, migrated) -> None:
    """Each run's `IF NOT EXISTS ... CREATE ROLE` and grants raced another's: a unique violation on
    pg_authid, or 'tuple concurrently updated', and exit 1 from some init containers."""
    failures: list[BaseException] = []
    for _ in range(3):  # the race was lost in about 2 rounds of 3
        drop_roles(pg_dsn, migrated)
        start = threading.Barrier(4)

        def run() -> None:
            try:
                with psycopg.connect(pg_dsn, autocommit=True) as conn:
                    start.wait(10)
                    roles.create(conn, migrated)
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=run) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures, failures
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        granted = conn.execute(
            "SELECT bool_and(has_function_privilege(%s, p.oid, 'EXECUTE')) FROM pg_proc p"
            " WHERE p.pronamespace = %s::regnamespace AND p.proname = 'ack'",
            [roles.role_name(migrated, "consumer"), f'"{migrated}"'],
        ).fetchone()
    assert granted == (True,)


def test_roles_created_while_the_schema_migrates(pg_dsn, migrated) -> None:
    """`migrate` grants new functions to the roles that exist: it and `--roles create` queue on one lock."""
    failures: list[BaseException] = []

    def run(step) -> None:
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                step(conn)
        except BaseException as exc:
            failures.append(exc)

    steps = [lambda c: roles.create(c, migrated), lambda c: migrate(c, migrated)] * 2
    threads = [threading.Thread(target=run, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures


@pytest.mark.parametrize("migrated", ["Rc_Mixed_"], indirect=True)
def test_roles_of_a_schema_with_capitals(pg_dsn, migrated) -> None:
    """The schema's name was given to ::regnamespace unquoted, which folds it to lower case: `--roles
    print` failed (schema "rc_mixed_..." does not exist), or read a lower-case twin's tables."""
    twin = migrated.lower()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(twin)))
        conn.execute(sql.SQL("CREATE TABLE {} (x int)").format(sql.Identifier(twin, "twin_only")))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
        env |= {"REAPER_DATABASE__DSN": pg_dsn, "REAPER_DATABASE__SCHEMA": migrated}
        r = run_cli(["migrate", "--roles", "print"], env)
        assert r.returncode == ExitCode.OK, r.stderr
        assert f'GRANT USAGE ON SCHEMA "{migrated}"' in r.stdout, r.stdout
        assert f'GRANT SELECT ON "{migrated}"."outbox" TO "{migrated}_operator"' in r.stdout, r.stdout
        assert "twin_only" not in r.stdout
        assert f'"{migrated}"."ack"(' in r.stdout, r.stdout
        r = run_cli(["migrate", "--roles", "create"], env)
        assert r.returncode == ExitCode.OK, r.stderr
    finally:
        drop_schema(pg_dsn, twin)
