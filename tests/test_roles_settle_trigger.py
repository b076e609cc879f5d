"""The commit-time settle of claims runs as the schema's owner (a consumer role of the SQL functions
has no table privileges), and writes completion events into the table a settle request names. The
Python API's role may insert such requests itself: one naming a table of another schema (where it
has no privilege), or a topic Kafka refuses, fails its own commit and writes nothing."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql
from support.teardown import drop_roles

import tracker
from tracker import roles


@pytest.fixture
def granted(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        for stmt in roles.grants(c, schema):
            c.execute(stmt)
    yield schema
    drop_roles(pg_dsn, schema)


def test_app_role_cannot_write_into_another_schemas_outbox_through_the_definer_trigger(pg_dsn, granted, other_schema):
    schema = granted
    app = f"{schema}_app"
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, schema=schema)
        (g,) = tracker.add_items(c, b, 1, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        (victim_oid,) = c.execute("SELECT %s::regclass::oid", [f'"{other_schema}".outbox']).fetchone()
        c.commit()
    with psycopg.connect(pg_dsn) as c:
        c.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(app)))
        # the app role may not write the other schema's outbox itself
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            c.execute(
                sql.SQL("INSERT INTO {} (topic, key, value) VALUES ('x', 'k', 'v')").format(
                    sql.Identifier(other_schema, "outbox")
                )
            )
        c.rollback()
        c.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(app)))
        c.execute(
            sql.SQL("INSERT INTO {} (batch_id, group_id, idx) VALUES (%s, %s, 0)").format(
                sql.Identifier(schema, "ack_claim")
            ),
            [b.id, g.group_id],
        )
        c.execute(
            sql.SQL("INSERT INTO {} (batch_id, outbox, topic) VALUES (%s, %s::oid::regclass, 'chosen-topic')").format(
                sql.Identifier(schema, "ack_settle_request")
            ),
            [b.id, victim_oid],
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="not in schema"):
            c.commit()  # the deferred SECURITY DEFINER trigger fires here, as the schema's owner
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(sql.SQL("SELECT topic FROM {}").format(sql.Identifier(other_schema, "outbox"))).fetchall()
    assert rows == [], f"the app role of {schema} wrote into {other_schema}.outbox: {rows}"
