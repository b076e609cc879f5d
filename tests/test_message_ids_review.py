"""The message-id namespace where the first cut missed it: an outbox in a schema `reaper migrate`
never ran in (a harvest unit's own table), the least-privilege reaper role after an upgrade, and a
caller's transaction when the read fails."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import sql
from support.harness import Receiver, make_config, marked, wait_until
from support.teardown import drop_role, drop_schema

from harvester.units import Harvester
from tracker import message_ids, roles
from tracker import schema as schema_mod
from tracker.message_ids import MESSAGE_ID_HEADER, NamespaceUnavailable


def test_a_unit_whose_schema_was_never_migrated_publishes_with_message_ids(
    pg_dsn, kafka_bootstrap, schema, bare_schema, topics
):
    """The claim table is created by the reaper in such a schema; so must the namespace be, or
    the unit never publishes a record."""
    topic = topics("data", partitions=1)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{bare_schema}".orders (LIKE "{schema}".outbox INCLUDING ALL)')
        c.execute(
            f"INSERT INTO \"{bare_schema}\".orders (topic, value) SELECT %s, ('v' || i)::bytea"
            " FROM generate_series(1, 20) i",
            [topic],
        )
        ids = {bytes(v): (i, at) for i, v, at in c.execute(f'SELECT id, value, created_at FROM "{bare_schema}".orders')}
    outboxes = [{"name": "orders", "schema": bare_schema, "table": "orders"}]
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"outboxes": outboxes})
    receiver = Receiver(kafka_bootstrap, topic, 1)
    h = Harvester(cfg).start()
    try:
        assert wait_until(lambda: set(ids) <= set(receiver.values()), 60), "the unit published nothing"
    finally:
        h.stop(5)
        receiver.close()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        ns = message_ids.namespace(c, bare_schema, "orders")
    for _, value, headers in receiver.records:
        assert [v for k, v in headers if k == MESSAGE_ID_HEADER] == [message_ids.message_id(ns, *ids[value]).encode()]


def test_the_reaper_role_granted_before_the_upgrade_reads_the_namespace(pg_dsn, tmp_path):
    """Roles granted (`reaper migrate --roles create`) on the schema before this release, then the
    documented upgrade (`reaper migrate`): the reaper's role must still be able to harvest."""
    sql_dir = tmp_path / "sql"
    sql_dir.mkdir()
    for path in schema_mod._files(None):
        if not path.name[:4].isdigit() or int(path.name[:4]) < 17:  # the schema before this release
            (sql_dir / path.name).write_text(path.read_text())
    name = f"t_{uuid.uuid4().hex[:12]}"
    login = f"login_reaper_{uuid.uuid4().hex[:8]}"
    try:
        schema_mod.migrate(pg_dsn, name, sql_dir)
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            roles.create(admin, name)
            admin.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    sql.Identifier(login), sql.Identifier(roles.role_name(name, "reaper"))
                )
            )
            assert admin.execute("SELECT to_regclass(%s)", [f'"{name}".outbox_namespace']).fetchone() == (None,)
        assert "0017_message_id.sql" in schema_mod.migrate(pg_dsn, name)
        with psycopg.connect(pg_dsn.replace("postgres@", f"{login}@"), autocommit=True) as c:
            assert isinstance(message_ids.namespace(c, name), message_ids.Namespace)
            # and a table the migrations did not make is registered by that role too
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            admin.execute(f'CREATE TABLE "{name}".outbox2 (LIKE "{name}".outbox INCLUDING ALL)')
            admin.execute(
                sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                    sql.Identifier(name, "outbox2"), sql.Identifier(roles.role_name(name, "reaper"))
                )
            )
        with psycopg.connect(pg_dsn.replace("postgres@", f"{login}@"), autocommit=True) as c:
            assert isinstance(message_ids.namespace(c, name, "outbox2"), message_ids.Namespace)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as admin:
            drop_role(admin, login)
            for r in roles.ROLES:
                drop_role(admin, roles.role_name(name, r))
            drop_schema(pg_dsn, name)


def test_a_failed_namespace_read_leaves_the_callers_transaction_usable(pg_dsn, schema, bare_schema):
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'CREATE TABLE "{bare_schema}".mine (x int)')
        c.execute(f'INSERT INTO "{bare_schema}".mine VALUES (1)')
        with pytest.raises(NamespaceUnavailable):
            message_ids.namespace(c, schema, "no_such_table")
        with pytest.raises(NamespaceUnavailable):
            message_ids.namespace(c, bare_schema, "mine")  # no namespace table in that schema
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert c.execute(f'SELECT x FROM "{bare_schema}".mine').fetchall() == [(1,)]
        c.rollback()


def test_a_namespace_read_works_with_any_row_factory(pg_dsn, schema):
    from psycopg.rows import dict_row, namedtuple_row

    with psycopg.connect(pg_dsn, autocommit=True) as c:
        expected = message_ids.namespace(c, schema)
    for factory in (dict_row, namedtuple_row):
        with psycopg.connect(pg_dsn, autocommit=True, row_factory=factory) as c:
            assert message_ids.namespace(c, schema) == expected
            with pytest.raises(NamespaceUnavailable, match="does not exist"):
                message_ids.namespace(c, schema, "no_such_table")


def test_a_registration_by_the_first_call_of_a_transaction_is_undone_by_its_rollback(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".outbox5 (LIKE "{schema}".outbox INCLUDING ALL)')
    with psycopg.connect(pg_dsn) as c:  # not autocommit, no statement yet: the call opens the transaction
        message_ids.namespace(c, schema, "outbox5")
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        c.rollback()
        rows = c.execute(
            f'SELECT count(*) FROM "{schema}".outbox_namespace WHERE outbox = %s::regclass', [f'"{schema}".outbox5']
        ).fetchone()
        assert rows == (0,)
        c.rollback()


def _ids_as_marked(pg_dsn: str, schema: str) -> list[str]:
    """The message ids the harvester gives the rows of `schema`.outbox now (marked as it marks them,
    the namespace read as it reads it, in a schema migrated or not)."""
    _ids, rows = marked(pg_dsn, schema)
    return [r[-1] for r in rows]


@pytest.mark.parametrize("how", ["migrate", "harvester"])
def test_a_row_an_application_dated_before_the_install_never_shares_an_id(pg_dsn, schema, bare_schema, how):
    """No earlier version published anything from a table of a fresh install, so no row of it keeps
    the short id: a row whose created_at the application wrote (an event's time, a clock behind the
    database's) earlier than the install is named by it too, and a row id used again is a new id."""
    where = schema
    if how == "harvester":  # a schema `reaper migrate` never ran in: the reaper creates the namespace table
        where = bare_schema
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'CREATE TABLE "{where}".outbox (LIKE "{schema}".outbox INCLUDING ALL)')
    seen: list[str] = []
    for at in ("2020-01-01 00:00:00+00", "2020-01-02 00:00:00+00"):
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'TRUNCATE "{where}".outbox RESTART IDENTITY')
            # id 1 again, as after the restart (a table made LIKE another shares that one's sequence)
            c.execute(f"INSERT INTO \"{where}\".outbox (id, topic, value, created_at) VALUES (1, 't', 'v', %s)", [at])
        seen += _ids_as_marked(pg_dsn, where)
    assert len(seen) == 2 and seen[0] != seen[1], seen


def test_a_table_recreated_under_a_running_leader_is_published_under_its_own_namespace(
    pg_dsn, kafka_bootstrap, schema, bare_schema, topics
):
    """Dropped and created again in one transaction (a restore with --single-transaction, say), the
    table has a new namespace; a leader that read the old one must not name the new rows by it, or
    the next leader publishes them again under another id."""
    topic = topics("data", partitions=1)
    make = f'CREATE TABLE "{bare_schema}".orders (LIKE "{schema}".outbox INCLUDING ALL)'
    ins = f'INSERT INTO "{bare_schema}".orders (topic, value) VALUES (%s, %s)'
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(make)
        c.execute(ins, [topic, b"first"])
    outboxes = [{"name": "orders", "schema": bare_schema, "table": "orders"}]
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"outboxes": outboxes})
    receiver = Receiver(kafka_bootstrap, topic, 1)
    h = Harvester(cfg).start()
    try:
        assert wait_until(lambda: b"first" in set(receiver.values()), 60)
        with psycopg.connect(pg_dsn) as c:  # one transaction, as a single-transaction restore does
            c.execute(f'DROP TABLE "{bare_schema}".orders')
            c.execute(make)
            c.execute(ins, [topic, b"second"])
        assert wait_until(lambda: b"second" in set(receiver.values()), 60)
    finally:
        h.stop(5)
        receiver.close()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        ns = message_ids.namespace(c, bare_schema, "orders")
    got = [
        v for _, value, headers in receiver.records if value == b"second" for k, v in headers if k == MESSAGE_ID_HEADER
    ]
    assert got and all(v.decode().startswith(ns.prefix) for v in got), (got, ns)
