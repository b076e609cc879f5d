"""Least-privilege roles for a tracker schema, as GRANT statements read off the schema itself.

Each role is a NOLOGIN group named `<schema>_<role>`; grant it to your login roles
(`GRANT reaper_producer TO billing_service`). The SQL functions a producer or a consumer calls run
as their owner (SECURITY DEFINER, with a pinned search_path: sql/R__sql_api.sql), so those callers get
EXECUTE on functions and no privilege on any table: they cannot touch the bits and counts the
guarantees rest on.

- producer: open_batch, add_items, enqueue, close_batch, batch_status (functions only);
- consumer: ack, ack_masks, fail, fail_masks, batch_status, failures, inbox_claim, inbox_show
  (functions only);
- operator: reads every table, batch_status, inbox_show and inbox_partitions; writes nothing;
- app: the Python API (`tracker.*`, and `tracker.spark`'s fan-out and acks) in the application's
  own transaction: it runs its statements on the tables, so DML on the tracker's tables and
  EXECUTE on the functions it calls;
- reaper: the sidecar (`reaper run` / `reaper serve`): DML on every table of the schema and
  EXECUTE on every function. VACUUM and the lane index need the outbox table's owner (or
  PostgreSQL 17's MAINTAIN): a reaper that is not skips them and says so;
- the migrator is whoever runs `reaper migrate` and owns what it creates; it needs CREATE on the
  database (for the schema) and no superuser.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from tracker.schema import (
    DEFINITIONS_TABLE,
    EVERY_FUNCTION_ROLES,
    MIGRATIONS_TABLE,
    ROLES,
    check_identifier,
    migration_lock_key,
    role_name,
)

PRODUCER_FUNCTIONS = ("open_batch", "add_items", "enqueue", "close_batch", "batch_status", "failures")
CONSUMER_FUNCTIONS = (
    "ack",
    "ack_masks",
    "fail",
    "fail_masks",
    "batch_status",
    "failures",
    "inbox_claim",
    "inbox_show",
)
OPERATOR_FUNCTIONS = ("batch_status", "inbox_show", "inbox_partitions")
# The inbox's partition upkeep, run as the owner (DDL) by the reaper role, which executes every function.
MAINTENANCE_FUNCTIONS = ("inbox_add_partitions", "inbox_drop_expired")
# The tables the Python API writes in the application's transaction (spark_fanout_run: tracker.spark's
# fan-out takes its run there, on the driver).
APP_TABLES = (
    "batch",
    "batch_group",
    "outbox",
    "ack_claim",
    "ack_settle_request",
    "child_finished",
    "group_failure",
    "failure_reason",
    "spark_fanout_run",
)


def _namespace(conn: psycopg.Connection, schema: str) -> str:
    # ::regnamespace reads its text as SQL does: unquoted, `Billing` would be schema billing
    return sql.Identifier(schema).as_string(conn)


def _functions(conn: psycopg.Connection, schema: str, names: tuple[str, ...] | None) -> list[str]:
    rows = conn.execute(
        "SELECT p.oid::regprocedure::text FROM pg_proc p WHERE p.pronamespace = %s::regnamespace"
        " AND (%s::text[] IS NULL OR p.proname = ANY(%s::text[])) AND p.prokind = 'f' ORDER BY 1",
        [_namespace(conn, schema), list(names) if names else None, list(names) if names else None],
    ).fetchall()
    return [r[0] for r in rows]


def _tables(conn: psycopg.Connection, schema: str) -> list[str]:
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c WHERE c.relnamespace = %s::regnamespace AND c.relkind IN ('r', 'p')"
        " ORDER BY 1",
        [_namespace(conn, schema)],
    ).fetchall()
    return [r[0] for r in rows]


def grants(conn: psycopg.Connection, schema: str) -> list[sql.Composed]:
    """The statements that create the roles (if missing) and grant each exactly what it needs,
    for the tables and functions the schema holds now (run `reaper migrate` first)."""
    s = sql.Identifier(check_identifier(schema, "schema"))
    out: list[sql.Composed] = []
    tables = _tables(conn, schema)
    everything = _functions(conn, schema, None)

    def fn(signature: str) -> sql.Composed:
        # regprocedure text is 'name(argtypes)', qualified when the schema is not on the search_path
        name, _, args = signature.partition("(")
        return sql.SQL("{}.{}({}").format(s, sql.Identifier(name.rpartition(".")[2].strip('"')), sql.SQL(args))

    for role in ROLES:
        r = sql.Identifier(role_name(schema, role))
        out.append(
            sql.SQL(
                "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {name}) THEN CREATE ROLE {r} NOLOGIN; "
                "END IF; END $$"
            ).format(name=sql.Literal(role_name(schema, role)), r=r)
        )
        out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
    per_role: dict[str, list[str]] = {
        "producer": _functions(conn, schema, PRODUCER_FUNCTIONS),
        "consumer": _functions(conn, schema, CONSUMER_FUNCTIONS),
        "operator": _functions(conn, schema, OPERATOR_FUNCTIONS),
        **{role: everything for role in EVERY_FUNCTION_ROLES},  # `reaper migrate` grants them new ones too
    }
    for role, functions in per_role.items():
        for f in functions:
            out.append(
                sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(fn(f), sql.Identifier(role_name(schema, role)))
            )
    for t in tables:
        table = sql.Identifier(schema, t)
        out.append(sql.SQL("GRANT SELECT ON {} TO {}").format(table, sql.Identifier(role_name(schema, "operator"))))
        if t in (MIGRATIONS_TABLE, DEFINITIONS_TABLE):  # what was migrated is the migrator's to write alone
            out.append(sql.SQL("GRANT SELECT ON {} TO {}").format(table, sql.Identifier(role_name(schema, "reaper"))))
            continue
        out.append(
            sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                table, sql.Identifier(role_name(schema, "reaper"))
            )
        )
        if t in APP_TABLES:
            out.append(
                sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON {} TO {}").format(
                    table, sql.Identifier(role_name(schema, "app"))
                )
            )
    for role in ("app", "reaper"):
        out.append(
            sql.SQL("GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {} TO {}").format(
                s, sql.Identifier(role_name(schema, role))
            )
        )
    return out


def script(conn: psycopg.Connection, schema: str) -> str:
    """`grants` as one SQL script, for a DBA to read and run."""
    return "".join(f"{stmt.as_string(conn)};\n" for stmt in grants(conn, schema))


def create(conn: psycopg.Connection, schema: str) -> None:
    """Run `grants` in one transaction (needs CREATEROLE, or the roles made beforehand), under the
    schema's migration lock (tracker.schema.migration_lock_key), so it is safe to run from several
    processes at once, as `reaper migrate` is: the later ones find the roles made and the grants
    given, and no grant races `migrate`'s own."""
    key = migration_lock_key(check_identifier(schema, "schema"))
    for attempt in range(2):
        try:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", [key])
                for stmt in grants(conn, schema):
                    conn.execute(stmt)
            return
        except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject):
            # Roles are the cluster's, the lock the database's: a run for a schema of the same name
            # in another database made a role meanwhile. Once more, and the role is found.
            if attempt:
                raise
