"""What `reaper migrate` decides about a schema, read from the catalog, for comparing two schemas:
its functions with their definitions and grants, columns, relations, indexes, constraints,
triggers and the schema's own grants. The schema's name reads SCHEMA, and its roles' names ROLE_."""

from __future__ import annotations

import psycopg
from psycopg import sql

_QUERIES = {
    "functions": "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid), p.prosecdef, p.proconfig::text,"
    " coalesce((SELECT array_agg(a::text ORDER BY a::text) FROM unnest(p.proacl) a)::text, '')"
    " FROM pg_proc p WHERE p.pronamespace = %(q)s::regnamespace ORDER BY 1",
    "columns": "SELECT table_name, column_name, data_type, is_nullable, coalesce(column_default, '')"
    " FROM information_schema.columns WHERE table_schema = %(s)s ORDER BY 1, 2",
    "relations": "SELECT c.relname, c.relkind, c.relpersistence, coalesce(c.reloptions::text, ''),"
    " coalesce(c.relacl::text, '') FROM pg_class c WHERE c.relnamespace = %(q)s::regnamespace ORDER BY 1",
    "indexes": "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %(s)s ORDER BY 1",
    "constraints": "SELECT t.relname, c.conname, pg_get_constraintdef(c.oid) FROM pg_constraint c"
    " JOIN pg_class t ON t.oid = c.conrelid WHERE c.connamespace = %(q)s::regnamespace ORDER BY 1, 2",
    "triggers": "SELECT tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
    " WHERE c.relnamespace = %(q)s::regnamespace AND NOT t.tgisinternal ORDER BY 1",
    "schema": "SELECT coalesce(nspacl::text, '') FROM pg_namespace WHERE nspname = %(s)s",
}


def normalised(schema: str, rows: list[tuple]) -> list[tuple]:
    """`rows` with the schema's name as SCHEMA and its roles' as ROLE_<role>."""

    def norm(value: object) -> object:
        return value.replace(f"{schema}_", "ROLE_").replace(schema, "SCHEMA") if isinstance(value, str) else value

    return [tuple(norm(v) for v in row) for row in rows]


def catalog_state(conn: psycopg.Connection, schema: str) -> dict[str, list]:
    """Everything migrate decides about `schema`, by kind (see the module's doc)."""
    params = {"s": schema, "q": sql.Identifier(schema).as_string(conn)}  # (q: for ::regnamespace)
    return {k: normalised(schema, conn.execute(q, params).fetchall()) for k, q in _QUERIES.items()}
