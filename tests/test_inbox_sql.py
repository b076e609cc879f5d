"""The inbox's SQL functions for other languages, and a consumer role that claims through them
and touches no table."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql

from tracker import roles


def test_the_sql_functions_for_other_languages(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        assert conn.execute(
            "SELECT inbox_claim('a', 'm'), inbox_claim('a', 'm'), inbox_claim('b', 'm')"
        ).fetchone() == (
            True,
            False,
            True,
        )
        rows = conn.execute("SELECT consumer_name, partition_name FROM inbox_show('m')").fetchall()
        assert [r[0] for r in rows] == ["a", "b"] and all(r[1].startswith("inbox_p") for r in rows)
        assert [r[0] for r in conn.execute("SELECT * FROM inbox_show('m', 'b')").fetchall()] == ["b"]
        assert conn.execute("SELECT count(*) FROM inbox_show('nope')").fetchone() == (0,)
        conn.commit()
        for bad, shown in [("''", ""), ("repeat('x', 201)", "x" * 60), ("NULL", "null")]:
            with pytest.raises(psycopg.DatabaseError) as err:
                conn.execute(f"SELECT inbox_claim('a', {bad})")
            assert err.value.sqlstate == "RT007" and err.value.diag.message_detail == shown
            conn.rollback()
        parts = conn.execute("SELECT name, attached, holds_ids FROM inbox_partitions()").fetchall()
        assert len(parts) >= 4 and all(a for _, a, _ in parts) and any(h for _, _, h in parts)


def test_a_consumer_role_claims_through_the_function_and_touches_no_table(pg_dsn, schema):
    from support.teardown import drop_role
    from test_roles import login_as

    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        roles.create(admin, schema)
    try:
        with login_as(pg_dsn, schema, "consumer") as conn:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            assert conn.execute("SELECT inbox_claim('a', %s)", [uuid.uuid4().hex]).fetchone() == (True,)
            conn.commit()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT count(*) FROM inbox")
            conn.rollback()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("SELECT inbox_drop_expired('1 day')")
            conn.rollback()
        with login_as(pg_dsn, schema, "operator") as conn:
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
            assert conn.execute("SELECT count(*) FROM inbox_partitions()").fetchone()[0] >= 4
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            for r in roles.ROLES:
                drop_role(admin, roles.role_name(schema, r))
