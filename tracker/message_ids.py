"""Message ids: the `message-id` header the harvester puts on every record it publishes.

The id is `<namespace>:<row id>`, ASCII, at most 56 characters: the namespace is a random UUID stored
once per outbox table in `<schema>.outbox_namespace` (sql/0017_message_id.sql), the row id is the
outbox row's, from a sequence that only goes up (README "Event reference": what sets it back makes
ids come again, and what to do then). So the id names one row across databases, tables and
lanes, and is the same every time the row is published again (a reset, a remark, a new leader, a
promoted standby or a restored backup: the namespace is a row like any other, replicated and kept).
Rows written by any language or by the tracker's own SQL (completion and expiry events) get it
alike: the harvester adds it as it publishes; nothing is stored per row.

The header comes last, after the row's own headers; `message_id_of` reads the last one.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row

from tracker import schema as schema_mod
from tracker.config import DEFAULT_OUTBOX_TABLE
from tracker.errors import InvalidValue, TrackerError
from tracker.schema import check_identifier, qualified

MESSAGE_ID_HEADER = "message-id"
MESSAGE_ID_MAX = 100  # the documented bound on the header's length (ids are at most 56 characters)
NAMESPACE_TABLE = "outbox_namespace"
NAMESPACE_MIGRATION = 17  # sql/0017_message_id.sql creates NAMESPACE_TABLE


class NamespaceUnavailable(TrackerError, LookupError):
    """The schema has no namespace table (not migrated to this version) or the outbox table does not exist."""

    def __init__(self, schema: str, table: str, detail: str, *, missing_table: bool = False) -> None:
        self.schema, self.table = schema, table
        self.missing_table = missing_table  # the schema has no namespace table (tracker.message_ids.create_table)
        super().__init__(f"no message-id namespace for {schema}.{table}: {detail} (run `reaper migrate`)")


def message_id(namespace: uuid.UUID | str, row_id: int) -> str:
    """The message id of outbox row `row_id` of the table whose namespace is `namespace`."""
    return f"{namespace}:{row_id}"


def prefix(namespace: uuid.UUID) -> str:
    """What the harvester puts before a row id (built once per leadership, not per record)."""
    return f"{namespace}:"


def message_id_of(message: Any) -> str | None:
    """The message id of a Kafka message (confluent_kafka Message, or anything with `.headers()` as
    a list of (name, bytes)): its last `message-id` header, or None when it has none. Raises
    InvalidValue when that header is not ASCII of 1 to MESSAGE_ID_MAX characters."""
    headers = message.headers() if callable(getattr(message, "headers", None)) else getattr(message, "headers", None)
    raw: bytes | str | None = None
    for name, value in headers or ():
        if name == MESSAGE_ID_HEADER:
            raw = value
    if raw is None:
        return None
    text = raw if isinstance(raw, str) else bytes(raw).decode("latin-1")
    if not 1 <= len(text) <= MESSAGE_ID_MAX or not text.isascii():
        raise InvalidValue(MESSAGE_ID_HEADER, raw[:MESSAGE_ID_MAX], f"must be 1 to {MESSAGE_ID_MAX} ASCII characters")
    return text


def namespace(conn: psycopg.Connection, schema: str, table: str = DEFAULT_OUTBOX_TABLE) -> uuid.UUID:
    """The namespace of `schema.table`'s message ids. A table the migrations did not create gets
    one the first time (several processes at once agree on one). Runs in `conn`'s transaction
    (never commits it; a failure leaves it as it was: the statements run in a savepoint), with
    any row factory; the harvester calls it in autocommit. Raises NamespaceUnavailable."""
    names = {"ns": qualified(schema, NAMESPACE_TABLE)}
    table_name = qualified(schema, check_identifier(table, "table")).as_string(conn)
    read = sql.SQL("SELECT namespace FROM {ns} WHERE outbox = to_regclass(%s)").format(**names)
    if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        # Open the caller's implicit transaction first: a transaction() block entered outside one
        # would BEGIN and COMMIT a transaction of its own, which the caller could not roll back.
        conn.execute("SELECT 1")
    try:
        # A savepoint in the caller's transaction (a transaction of its own in autocommit): a
        # failed statement must not leave the caller's transaction aborted.
        with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            found = cur.execute(read, [table_name]).fetchone()
            if found is None:
                if cur.execute("SELECT to_regclass(%s)", [table_name]).fetchone() == (None,):
                    raise NamespaceUnavailable(schema, table, "the table does not exist")
                # Two statements: a later one sees a row another process inserted meanwhile (the
                # conflict waited for its commit), where one statement's snapshot would not.
                cur.execute(
                    sql.SQL("INSERT INTO {ns} (outbox) VALUES (%s::regclass) ON CONFLICT (outbox) DO NOTHING").format(
                        **names
                    ),
                    [table_name],
                )
                found = cur.execute(read, [table_name]).fetchone()
    except psycopg.errors.UndefinedTable as exc:
        raise NamespaceUnavailable(schema, table, f"{schema}.{NAMESPACE_TABLE} is missing", missing_table=True) from exc
    assert found is not None  # inserted or found by the statements above
    return found[0]


def create_table(conn: psycopg.Connection, schema: str) -> None:
    """Create `schema`'s namespace table when it has none (an outbox in a schema `reaper migrate`
    never ran in), as migration 0017 does, under the migration's advisory lock so a concurrent
    `reaper migrate` queues. Needs an autocommit connection (it commits its own transaction).
    Raises NamespaceUnavailable, naming the statements to run, when the role may not."""
    text = next((m.text for m in schema_mod.migrations() if m.version == NAMESPACE_MIGRATION), None)
    if text is None:
        raise RuntimeError(f"migration {NAMESPACE_MIGRATION:04d} is missing from this installation")
    path = sql.Identifier(check_identifier(schema, "schema")).as_string(conn)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [schema_mod.migration_lock_key(schema)])
            conn.execute("SELECT set_config('search_path', %s, true)", [path])
            conn.execute(text)
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.InvalidSchemaName) as exc:
        raise NamespaceUnavailable(
            schema,
            NAMESPACE_TABLE,
            f"this role cannot create it ({exc}); have the schema's owner run:\nSET search_path TO {path};\n{text}",
        ) from None
    except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable):
        pass  # created at the same moment by a session that does not take the lock
