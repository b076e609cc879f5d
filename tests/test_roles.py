"""Least privilege, logged in as each role: it can do its job and nothing else.

The group roles come from `tracker.roles` (what `reaper migrate --roles create` runs); each test
logs in as a role that is a member of one of them, never as the owner.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors, sql
from support.teardown import drop_role, drop_schema

import tracker
from tracker import roles
from tracker.schema import migrate


@pytest.fixture
def granted(pg_dsn, schema) -> Iterator[str]:
    """The schema's roles created and granted; dropped afterwards (roles are the cluster's)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        roles.create(conn, schema)
    try:
        yield schema
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for r in roles.ROLES:
                drop_role(conn, roles.role_name(schema, r))


@contextlib.contextmanager
def login_as(pg_dsn: str, schema: str, role: str) -> Iterator[psycopg.Connection]:
    name = f"login_{role}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(name), sql.Identifier(roles.role_name(schema, role))
            )
        )
    try:
        with psycopg.connect(pg_dsn.replace("postgres@", f"{name}@")) as conn:
            yield conn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            drop_role(admin, name)


def _closed_batch(pg_dsn: str, schema: str, n: int):
    """A closed batch of n items, made by the schema's owner: (batch, its group handle)."""
    with psycopg.connect(pg_dsn) as owner:
        batch = tracker.open_batch(owner, schema=schema)
        (handle,) = tracker.add_items(owner, batch, n, schema=schema)
        tracker.close_batch(owner, batch, schema=schema)
        owner.commit()
    return batch, handle


@contextlib.contextmanager
def _schema_creator(pg_dsn: str, prefix: str) -> Iterator[tuple[str, str, str]]:
    """A login role that may only create schemas in the database (no superuser), and a schema name
    for it: (role, its DSN, schema). The schema, the grant and the role go afterwards."""
    role, name = f"{prefix}_{uuid.uuid4().hex[:8]}", f"{prefix[0]}_{uuid.uuid4().hex[:10]}"
    db = sql.Identifier(psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"])
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        admin.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(db, sql.Identifier(role)))
    try:
        yield role, pg_dsn.replace("postgres@", f"{role}@"), name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            drop_schema(pg_dsn, name)
            admin.execute(sql.SQL("REVOKE CREATE ON DATABASE {} FROM {}").format(db, sql.Identifier(role)))
            drop_role(admin, role)


def _denied(conn: psycopg.Connection, statement: str, params: list | None = None) -> None:
    conn.execute("SAVEPOINT denied")
    with pytest.raises(errors.InsufficientPrivilege):
        conn.execute(statement, params)
    conn.execute("ROLLBACK TO SAVEPOINT denied")


def _call(conn: psycopg.Connection, schema: str, call: str, params: list) -> list[tuple]:
    return conn.execute(sql.SQL("SELECT * FROM {}." + call).format(sql.Identifier(schema)), params).fetchall()


def test_a_producer_uses_the_functions_and_cannot_touch_the_tables(pg_dsn, granted):
    s = granted
    with login_as(pg_dsn, s, "producer") as conn:
        ((batch_id,),) = _call(conn, s, "open_batch(%s, %s)", ["catalog-1", None])
        groups = _call(conn, s, "add_items(%s, %s)", [batch_id, 3])
        assert [(g[0], g[1]) for g in groups] == [(batch_id, 0)]
        assert _call(conn, s, "close_batch(%s, %s)", [batch_id, "batch-completions"]) == [(False,)]
        assert _call(conn, s, "batch_status(%s)", [batch_id])[0][0] == "closed"
        conn.commit()
        _denied(conn, f"UPDATE \"{s}\".batch_group SET bits = B'000', pending = 0 WHERE batch_id = %s", [batch_id])
        _denied(conn, f'UPDATE "{s}".batch SET pending = 0 WHERE id = %s', [batch_id])
        _denied(conn, f'SELECT * FROM "{s}".batch')
        _denied(conn, f'SELECT * FROM "{s}".ack(%s)', [[f"{batch_id}:0:0"]])
        _denied(conn, f'SELECT * FROM "{s}".ack_claim_items(%s, %s, %s, %s, %s)', [[1], [0], [0], f'"{s}".outbox', "t"])


def test_a_consumer_acks_and_completes_through_the_functions_only(pg_dsn, granted):
    s = granted
    batch, handle = _closed_batch(pg_dsn, s, 2)
    with login_as(pg_dsn, s, "consumer") as conn:
        ((acked, duplicates, completed),) = _call(conn, s, "ack(%s, %s)", [handle.item_ids, "batch-completions"])
        assert (acked, duplicates, completed) == (2, 0, [])  # claims: the batch completes at the commit
        conn.commit()
        _denied(conn, f'INSERT INTO "{s}".outbox (topic, value) VALUES (%s, %s)', ["any-topic", b"x"])
        _denied(conn, f'UPDATE "{s}".batch_group SET bits = bits')
        _denied(conn, f'SELECT * FROM "{s}".open_batch(%s, %s)', [None, None])
    with psycopg.connect(pg_dsn) as owner:
        assert tracker.status(owner, batch, schema=s).state == "complete"
        events = owner.execute(f'SELECT count(*) FROM "{s}".outbox WHERE topic = %s', ["batch-completions"]).fetchone()
        assert events == (1,)


def test_an_operator_reads_everything_and_writes_nothing(pg_dsn, granted):
    s = granted
    with psycopg.connect(pg_dsn) as owner:
        batch = tracker.open_batch(owner, schema=s)
        owner.commit()
    with login_as(pg_dsn, s, "operator") as conn:
        for table in ("batch", "batch_group", "outbox", "outbox_dead", "harvest_claim", "schema_migrations"):
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(s, table))).fetchone()
        assert _call(conn, s, "batch_status(%s)", [batch.id])[0][0] == "open"
        _denied(conn, f'INSERT INTO "{s}".outbox (topic, value) VALUES (%s, %s)', ["t", b"x"])
        _denied(conn, f'UPDATE "{s}".batch SET state = %s', ["expired"])
        _denied(conn, f'DELETE FROM "{s}".batch')
        _denied(conn, f'SELECT * FROM "{s}".close_batch(%s, %s)', [batch.id, "t"])


def test_the_python_api_runs_as_the_app_role_in_its_own_transaction(pg_dsn, granted):
    s = granted
    with login_as(pg_dsn, s, "app") as conn:
        batch = tracker.open_batch(conn, schema=s)
        (handle,) = tracker.add_items(conn, batch, 4, schema=s)
        enqueued = tracker.outbox.enqueue(conn, batch, [b"v", b"w"], topic="items", schema=s)
        tracker.close_batch(conn, batch, schema=s)
        conn.commit()
        ids = handle.item_ids + [i for h in enqueued for i in h.item_ids]
        assert tracker.ack(conn, ids[:2], schema=s).acked == 2  # the claims path: a function and a trigger
        conn.commit()
        assert tracker.ack(conn, ids[2:], schema=s, claims=False).acked == 4  # the masked path
        conn.commit()
        assert tracker.status(conn, batch, schema=s).state == "complete"
        _denied(conn, f'DELETE FROM "{s}".outbox_dead')  # the sidecar's tables are not the app's


def test_the_reaper_role_applies_masks_and_drains_the_outbox(pg_dsn, granted):
    s = granted
    batch, handle = _closed_batch(pg_dsn, s, 3)
    with login_as(pg_dsn, s, "reaper") as conn:
        result = tracker.apply_masks(
            conn, tracker.fold(handle.item_ids), schema=s, reject_invalid=True, skip_locked=True
        )
        assert result.acked == 3 and result.completed == [batch.id]
        conn.commit()
        rows = conn.execute(f'DELETE FROM "{s}".outbox RETURNING topic').fetchall()
        assert ("batch-completions",) in rows
        conn.commit()


# GRANT/REVOKE ON DATABASE rewrite one catalog row: on two workers at once, "tuple concurrently updated"
@pytest.mark.xdist_group("database-acl")
def test_reaper_migrate_works_without_superuser_and_prints_the_grants(pg_dsn):
    with _schema_creator(pg_dsn, "migrator") as (role, dsn, name):
        assert migrate(dsn, name)  # every migration, as a role that only may create a schema
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert not conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()[0]
            text = roles.script(conn, name)
            owner = conn.execute(
                "SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc WHERE pronamespace = %s::regnamespace", [name]
            ).fetchall()
        assert owner == [(role,)]
        assert f'GRANT EXECUTE ON FUNCTION "{name}"."ack"(text[],text,boolean) TO "{name}_consumer"' in text
        assert f'"{name}_producer"' in text and "batch_group" not in text.split(f'"{name}_producer"')[0][-200:]


def test_reaper_migrate_roles_print_is_a_script_a_dba_can_run(pg_dsn):
    import os
    import subprocess
    import sys
    from pathlib import Path

    name = f"p_{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(REAPER_DATABASE__DSN=pg_dsn, REAPER_DATABASE__SCHEMA=name)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "harvester.cli", "migrate", "--roles", "print"],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        assert all(line.startswith(("--", "GRANT", "DO $$")) for line in r.stdout.splitlines() if line), r.stdout
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(r.stdout)  # as printed: creates the roles and grants
            assert admin.execute("SELECT count(*) FROM pg_roles WHERE rolname LIKE %s", [f"{name}\\_%"]).fetchone() == (
                len(roles.ROLES),
            )
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for role in roles.ROLES:
                drop_role(admin, roles.role_name(name, role))
            drop_schema(pg_dsn, name)


def test_after_migrate_no_function_is_executable_by_public_and_the_callers_run_as_owner(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT p.proname, has_function_privilege('public', p.oid, 'EXECUTE'), p.prosecdef"
            " FROM pg_proc p WHERE p.pronamespace = %s::regnamespace",
            [schema],
        ).fetchall()
    assert rows and not [name for name, public, _ in rows if public], "PUBLIC may execute these"
    definer = {name for name, _, secdef in rows if secdef}
    callers = roles.PRODUCER_FUNCTIONS + roles.CONSUMER_FUNCTIONS + roles.OPERATOR_FUNCTIONS
    # and the commit-time settle of claims, a trigger that fires at a consumer role's commit too
    assert definer == {*callers, *roles.MAINTENANCE_FUNCTIONS, "ack_settle_at_commit"}


def _executable(conn: psycopg.Connection, schema: str) -> dict[str, list[str]]:
    """Each of the schema's roles: the schema's functions it may execute."""
    out: dict[str, list[str]] = {}
    for role in roles.ROLES:
        rows = conn.execute(
            "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.pronamespace = %s::regnamespace"
            " AND has_function_privilege(%s, p.oid, 'EXECUTE') ORDER BY 1",
            [schema, roles.role_name(schema, role)],
        ).fetchall()
        out[role] = [r[0] for r in rows]
    return out


def test_every_role_keeps_its_functions_when_migrate_applies_the_definitions_again(pg_dsn, granted):
    """An upgrade that changes the definitions makes some functions again (dropped, then created:
    their grants go with them); each role must end with EXECUTE on all it had."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        before = _executable(conn, granted)
        assert "batch_status" in str(before["operator"]) and "batch_status" in str(before["producer"])
        conn.execute(
            sql.SQL("UPDATE {} SET checksum = 'changed'").format(sql.Identifier(granted, "schema_definitions"))
        )
        assert "R__sql_api.sql" in migrate(conn, granted)
        assert _executable(conn, granted) == before


def test_the_reaper_role_reads_but_never_writes_which_migrations_ran(pg_dsn, granted):
    s = granted
    with login_as(pg_dsn, s, "reaper") as conn:
        assert (
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(s, "schema_migrations"))).fetchone()[
                0
            ]
            > 0
        )
        _denied(conn, f'DELETE FROM "{s}".schema_migrations')


# GRANT/REVOKE ON DATABASE rewrite one catalog row: on two workers at once, "tuple concurrently updated"
@pytest.mark.xdist_group("database-acl")
def test_an_upgrade_by_the_schemas_owner_needs_no_create_on_the_database(pg_dsn):
    with _schema_creator(pg_dsn, "owner") as (role, dsn, name):
        assert migrate(dsn, name)
        db = sql.Identifier(psycopg.conninfo.conninfo_to_dict(pg_dsn)["dbname"])
        with psycopg.connect(pg_dsn, autocommit=True) as admin:  # the first install done, CREATE taken back
            admin.execute(sql.SQL("REVOKE CREATE ON DATABASE {} FROM {}").format(db, sql.Identifier(role)))
        assert migrate(dsn, name) == []  # the owner's next run (an upgrade) needs no CREATE on the database
