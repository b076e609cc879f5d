"""Migrations as upgrades: a schema migrated by the chain this tree replaced (the numbered files
that held function bodies, run by the migrator of that time, both read from git) and then by this
tree ends exactly as a fresh one: the same function definitions, tables, indexes, constraints,
triggers and privileges. A changed repeatable definition is applied again, and only it; a replaced
file recorded with another checksum than the baseline names is drift."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from support.catalog import catalog_state
from support.history import files_at, sql_at
from support.scripts import load_script
from support.teardown import drop_roles, drop_schema

import tracker
from tracker import roles
from tracker import schema as schema_mod

# The last commit whose sql/ held the function bodies in numbered files.
OLD_CHAIN = "c4a30f3"


@pytest.fixture(scope="module")
def old_migrator(tmp_path_factory):
    """The old chain's sql/ and its tracker/schema.py, from git, as a module migrating from them."""
    root = files_at(OLD_CHAIN, ["sql", "tracker/schema.py"], tmp_path_factory.mktemp("old-chain"))
    module = load_script(root / "tracker" / "schema.py", "old_chain_schema", register=True)  # dataclasses
    assert [m.name for m in module.migrations()][-1] == "0015_batch_tenant.sql"
    return module


@pytest.fixture
def schemas(pg_dsn) -> Iterator[list[str]]:
    """Names for schemas of this test; they and their roles are dropped afterwards."""
    names: list[str] = []
    yield names
    for name in names:
        drop_schema(pg_dsn, name)
        drop_roles(pg_dsn, name)


def _since_outcomes() -> list[str]:
    """The numbered migrations the old chains here have not applied: 0016 and every later one."""
    return [m.name for m in schema_mod.migrations() if m.version >= 16]


def _new(schemas: list[str]) -> str:
    schemas.append(f"t_{uuid.uuid4().hex[:12]}")
    return schemas[-1]


def test_a_schema_migrated_by_the_old_chain_ends_as_a_fresh_one(pg_dsn, old_migrator, schemas):
    old, fresh = _new(schemas), _new(schemas)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert len(old_migrator.migrate(conn, old)) == 13
        roles.create(conn, old)  # the roles as granted then: the new functions are not theirs yet
        before = catalog_state(conn, old)
        applied = schema_mod.migrate(conn, old)
        # Nothing versioned runs again (0006 is at the baseline); every definition is (re)applied.
        assert applied == [*_since_outcomes(), *[d.name for d in schema_mod.definitions()]]
        assert schema_mod.migrate(conn, old) == []
        # The Python API's statements call the new event functions as the app's and the reaper's
        # roles the moment the upgrade is done: migrate has granted them already.
        for role in ("app", "reaper"):
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE')",
                [roles.role_name(old, role), f'"{old}".completion_event("{old}".batch, text)'],
            ).fetchone() == (True,)
        roles.create(conn, old)  # `reaper migrate --roles create`, as every upgrade runs it
        upgraded = catalog_state(conn, old)

        assert schema_mod.migrate(conn, fresh)[:3] == ["0001_outbox.sql", "0002_batches.sql", "0005_spark_fanout.sql"]
        roles.create(conn, fresh)
        assert catalog_state(conn, fresh) == upgraded
    # The upgrade did change something: the events' functions are new, the SQL paths' completions
    # now carry the trace headers.
    assert len(upgraded["functions"]) > len(before["functions"])
    # open_batch gained parameters (parent, thresholds), ack one (claims): their old forms were replaced
    replaced = {"SCHEMA.open_batch(text,text)", "SCHEMA.ack(text[],text)"}
    assert {r[0] for r in before["functions"]} - replaced < {r[0] for r in upgraded["functions"]}
    assert "SCHEMA.open_batch(text,text,bigint,bigint,double precision)" in {r[0] for r in upgraded["functions"]}
    assert [r[1] for r in upgraded["functions"] if r[0].startswith("SCHEMA.close_batch")] != [
        r[1] for r in before["functions"] if r[0].startswith("SCHEMA.close_batch")
    ]
    # Tables and indexes were the old chain's already: the baseline added none; 0016 (outcomes)
    # only adds, but for the rule a threshold's early finish breaks; 0021 widens admin_log's actions.
    widened = ("batch_complete_has_nothing_pending", "admin_log_action_check")
    assert any("acks-requeue" in str(r) for r in upgraded["constraints"] if "admin_log_action_check" in str(r))
    for k in ("columns", "indexes", "constraints", "triggers"):
        kept = [r for r in before[k] if not any(w in str(r) for w in widened)]
        assert set(kept) <= {r for r in upgraded[k] if "schema_definitions" not in str(r)}, k
        assert len(kept) < len(before[k]) or k != "constraints"


def test_the_old_chain_partly_applied_upgrades_too(pg_dsn, old_migrator, schemas, tmp_path):
    """A schema the old chain took only to 0007 (an older release) gets the versioned files after it
    and every definition, and ends as a fresh one."""
    partial, fresh = _new(schemas), _new(schemas)
    old_sql = Path(old_migrator.__file__).parents[1] / "sql"
    early = tmp_path / "sql"
    early.mkdir()
    for path in sorted(old_sql.glob("*.sql"))[:5]:  # 0001, 0002, 0005, 0006, 0007
        shutil.copy(path, early / path.name)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert schema_mod.migrate(conn, partial, early)[-1] == "0007_sql_functions.sql"
        assert schema_mod.migrate(conn, partial)[:4] == [
            "0008_ops.sql",
            "0011_harvest_claim.sql",
            "0013_http_idempotency.sql",
            "0015_batch_tenant.sql",
        ]
        schema_mod.migrate(conn, fresh)
        assert catalog_state(conn, partial) == catalog_state(conn, fresh)


# The last commit whose R__events.sql made the events return one row (not inlinable).
ONE_ROW_EVENTS = "9bc4e59"


def test_events_that_returned_one_row_are_replaced_and_the_schema_ends_as_a_fresh_one(pg_dsn, schemas, tmp_path):
    """CREATE OR REPLACE cannot turn a function returning one row into a set-returning one:
    R__events.sql drops that shape in the transaction that defines the events again."""
    upgraded, fresh = _new(schemas), _new(schemas)
    tree = sql_at(ONE_ROW_EVENTS, tmp_path)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        schema_mod.migrate(conn, upgraded, tree)
        roles.create(conn, upgraded)
        retset = (
            "SELECT bool_and(proretset) FROM pg_proc WHERE pronamespace = %s::regnamespace AND proname LIKE '%%_event'"
        )
        assert conn.execute(retset, [upgraded]).fetchone() == (False,)
        # the numbered migrations since that commit (0016 on), then the definitions changed since it,
        # R__events.sql among them
        applied, numbered = schema_mod.migrate(conn, upgraded), len(_since_outcomes())
        assert applied[:numbered] == _since_outcomes() and "R__events.sql" in applied
        assert all(name.startswith("R__") for name in applied[numbered:])
        assert conn.execute(retset, [upgraded]).fetchone() == (True,)
        for role in ("app", "reaper"):
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE')",
                [roles.role_name(upgraded, role), f'"{upgraded}".expiry_event("{upgraded}".batch, text, text, jsonb)'],
            ).fetchone() == (True,)
        roles.create(conn, upgraded)  # `reaper migrate --roles create`, as every upgrade runs it: new tables
        schema_mod.migrate(conn, fresh)
        roles.create(conn, fresh)
        assert catalog_state(conn, upgraded) == catalog_state(conn, fresh)


def test_a_replaced_file_with_another_checksum_is_drift(pg_dsn, old_migrator, schemas):
    name = _new(schemas)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        old_migrator.migrate(conn, name)
        table = sql.Identifier(name, "schema_migrations")
        for version, pattern in (
            (12, "0012 applied .* baseline 0006_baseline.sql"),
            (6, "0006_baseline.sql was applied"),
        ):
            (checksum,) = conn.execute(
                sql.SQL("SELECT checksum FROM {} WHERE version = %s").format(table), [version]
            ).fetchone()
            conn.execute(sql.SQL("UPDATE {} SET checksum = 'edited' WHERE version = %s").format(table), [version])
            with pytest.raises(schema_mod.MigrationDrift, match=pattern):
                schema_mod.migrate(conn, name)
            conn.execute(sql.SQL("UPDATE {} SET checksum = %s WHERE version = %s").format(table), [checksum, version])
        assert schema_mod.migrate(conn, name) == [*_since_outcomes(), *[d.name for d in schema_mod.definitions()]]


def test_a_changed_definition_is_applied_again_and_only_it(pg_dsn, schemas, tmp_path):
    name = _new(schemas)
    tree = tmp_path / "sql"
    shutil.copytree(schema_mod._sql_dir(), tree, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        defined = [d.name for d in schema_mod.definitions(tree)]
        assert schema_mod.migrate(conn, name, tree)[-len(defined) :] == defined
        assert schema_mod.migrate(conn, name, tree) == []
        events = tree / "R__events.sql"
        events.write_text(
            events.read_text().replace("'completed_at', b.completed_at,", "'completed_at', b.completed_at, 'v', 2,")
        )
        assert schema_mod.migrate(conn, name, tree) == ["R__events.sql"]
        assert schema_mod.migrate(conn, name, tree) == []
        (definition,) = conn.execute(
            "SELECT pg_get_functiondef(%s::regprocedure)", [f'"{name}".completion_event("{name}".batch, text)']
        ).fetchone()
        assert "'v', 2" in definition
        # PUBLIC gets EXECUTE on a function CREATE makes; migrate takes it away again after every run.
        assert conn.execute(
            "SELECT count(*) FROM pg_proc p WHERE p.pronamespace = %s::regnamespace"
            " AND has_function_privilege('public', p.oid, 'EXECUTE')",
            [name],
        ).fetchone() == (0,)


def _old_chain_batch(conn: psycopg.Connection, schema: str, items: int = 2) -> list[str]:
    """A closed batch of `items` items made through the old chain's SQL functions; its item ids."""
    (b,) = conn.execute(sql.SQL("SELECT {}()").format(sql.Identifier(schema, "open_batch"))).fetchone()
    groups = conn.execute(sql.SQL("SELECT * FROM {}(%s, %s)").format(sql.Identifier(schema, "add_items")), [b, items])
    ids = [f"{bid}:{gid}:{i}" for bid, gid, start, upto in groups.fetchall() for i in range(start, upto)]
    conn.execute(sql.SQL("SELECT {}(%s)").format(sql.Identifier(schema, "close_batch")), [b])
    return ids


def test_an_upgrade_never_leaves_live_acks_between_two_definitions(pg_dsn, old_migrator, schemas):
    """While `reaper migrate` upgrades a running system, a consumer's ack that completes a batch
    commits: it never meets R__ack_claims.sql's ack_settle (which calls completion_event) committed
    before R__events.sql's completion_event. Here the upgrade is held between the two definitions
    (someone holds the row it records R__events.sql under); a kill there leaves the same state."""
    name = _new(schemas)
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        old_migrator.migrate(setup, name)
        ids = _old_chain_batch(setup, name)
    holder = psycopg.connect(pg_dsn)
    migrator = psycopg.connect(pg_dsn, autocommit=True)
    done: list[object] = []
    try:
        schema_mod._bookkeeping(holder, name)
        holder.commit()
        holder.execute(
            sql.SQL("INSERT INTO {} (name, checksum) VALUES ('R__events.sql', 'held')").format(
                sql.Identifier(name, "schema_definitions")
            )
        )
        worker = threading.Thread(target=lambda: done.append(_try(schema_mod.migrate, migrator, name)))
        worker.start()
        pid = migrator.info.backend_pid
        with psycopg.connect(pg_dsn, autocommit=True) as watch:
            deadline = time.monotonic() + 20
            while not watch.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", [pid]
            ).fetchone():
                assert time.monotonic() < deadline and worker.is_alive(), done
                time.sleep(0.05)
        # The upgrade waits now. A consumer acks the last items of a closed batch and commits.
        t = tracker.Tracker(schema=name)
        with psycopg.connect(pg_dsn) as consumer:
            t.ack(consumer, ids)
            consumer.commit()  # the commit-time settle completes the batch and writes its event
            (events,) = consumer.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE topic = 'batch-completions'").format(
                    sql.Identifier(name, "outbox")
                )
            ).fetchone()
        assert events == 1
    finally:
        holder.rollback()
        holder.close()
        worker.join(30)
        migrator.close()
    assert done and not isinstance(done[0], BaseException), done


def _try(f, *args):
    try:
        return f(*args)
    except BaseException as exc:  # reported by the test, not lost in the thread
        return exc


def test_a_migrate_killed_before_its_grants_is_repaired_by_the_next(pg_dsn, old_migrator, schemas, monkeypatch):
    """A migrate that dies after committing the new functions (each CREATE gives PUBLIC EXECUTE, and
    the app's and reaper's roles have no EXECUTE on the new ones) must not leave them so: the next
    migrate, which finds nothing to apply, still may not let PUBLIC run a SECURITY DEFINER function
    such as ack(), and the app's role must be able to complete batches."""
    name = _new(schemas)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        old_migrator.migrate(conn, name)
        roles.create(conn, name)
        real = schema_mod._privileges
        monkeypatch.setattr(schema_mod, "_privileges", lambda *a, **k: (_ for _ in ()).throw(SystemExit("killed")))
        with pytest.raises(SystemExit):
            schema_mod.migrate(conn, name)
        monkeypatch.setattr(schema_mod, "_privileges", real)
        schema_mod.migrate(conn, name)  # the operator runs it again
        public = conn.execute(
            "SELECT array_agg(p.proname ORDER BY p.proname) FROM pg_proc p WHERE p.pronamespace = %s::regnamespace"
            " AND has_function_privilege('public', p.oid, 'EXECUTE')",
            [name],
        ).fetchone()
        assert public == (None,)
        assert conn.execute(
            "SELECT has_function_privilege(%s, %s, 'EXECUTE')",
            [roles.role_name(name, "app"), f'"{name}".completion_event("{name}".batch, text)'],
        ).fetchone() == (True,)


def test_an_upgrade_waits_for_a_live_ack_that_holds_its_batch_and_never_deadlocks_with_it(
    pg_dsn, old_migrator, schemas
):
    """Every writer locks a batch's row before it reads or writes the batch's groups. A consumer's
    ack on the old chain has locked its batch when `reaper migrate` starts 0016 (which alters both
    tables): the upgrade must wait for that ack, not take the groups' table first and meet the
    ack's next statement in a deadlock (failing the ack or the upgrade)."""
    name = _new(schemas)
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        old_migrator.migrate(setup, name)
        ids = _old_chain_batch(setup, name)
    batch_id = int(ids[0].split(":")[0])
    migrator = psycopg.connect(pg_dsn, autocommit=True)
    done: list[object] = []
    worker = threading.Thread(target=lambda: done.append(_try(schema_mod.migrate, migrator, name)))
    try:
        with psycopg.connect(pg_dsn) as consumer:
            consumer.execute(
                sql.SQL("SELECT state FROM {} WHERE id = %s FOR NO KEY UPDATE").format(sql.Identifier(name, "batch")),
                [batch_id],
            )
            worker.start()
            pid = migrator.info.backend_pid
            with psycopg.connect(pg_dsn, autocommit=True) as watch:
                deadline = time.monotonic() + 20
                while not watch.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", [pid]
                ).fetchone():
                    assert time.monotonic() < deadline and worker.is_alive(), done
                    time.sleep(0.05)
            # The upgrade waits for the consumer, which goes on with its ack and commits.
            consumer.execute(sql.SQL("SELECT * FROM {}(%s)").format(sql.Identifier(name, "ack")), [ids])
            consumer.commit()
    finally:
        worker.join(30)
        migrator.close()
    assert done and not isinstance(done[0], BaseException), done
    with psycopg.connect(pg_dsn) as conn:
        (events,) = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE topic = 'batch-completions'").format(sql.Identifier(name, "outbox"))
        ).fetchone()
    assert events == 1
