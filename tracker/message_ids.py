"""Message ids: the `message-id` header the harvester puts on every record it publishes.

The id is `<namespace>:<row id>`, ASCII, at most 56 characters: the namespace is a random UUID stored
once per outbox table in `<schema>.outbox_namespace` (sql/0017_message_id.sql), the row id is the
outbox row's, which its table never reuses. So the id names one row across databases, tables and
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

from tracker.config import DEFAULT_OUTBOX_TABLE
from tracker.errors import InvalidValue, TrackerError
from tracker.schema import check_identifier, qualified

MESSAGE_ID_HEADER = "message-id"
MESSAGE_ID_MAX = 100  # the documented bound on the header's length (ids are at most 56 characters)
NAMESPACE_TABLE = "outbox_namespace"


class NamespaceUnavailable(TrackerError, LookupError):
    """The schema has no namespace table (not migrated to this version) or the outbox table does not exist."""

    def __init__(self, schema: str, table: str, detail: str) -> None:
        self.schema, self.table = schema, table
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
    (never commits it); the harvester calls it in autocommit. Raises NamespaceUnavailable."""
    names = {"ns": qualified(schema, NAMESPACE_TABLE)}
    table_name = qualified(schema, check_identifier(table, "table")).as_string(conn)
    read = sql.SQL("SELECT namespace FROM {ns} WHERE outbox = to_regclass(%s)").format(**names)
    try:
        found = conn.execute(read, [table_name]).fetchone()
        if found is None:
            if conn.execute("SELECT to_regclass(%s)", [table_name]).fetchone() == (None,):
                raise NamespaceUnavailable(schema, table, "the table does not exist")
            # Two statements: a later one sees a row another process inserted meanwhile (the
            # conflict waited for its commit), where one statement's snapshot would not.
            conn.execute(
                sql.SQL("INSERT INTO {ns} (outbox) VALUES (%s::regclass) ON CONFLICT (outbox) DO NOTHING").format(
                    **names
                ),
                [table_name],
            )
            found = conn.execute(read, [table_name]).fetchone()
    except psycopg.errors.UndefinedTable as exc:
        raise NamespaceUnavailable(schema, table, f"{schema}.{NAMESPACE_TABLE} is missing") from exc
    assert found is not None  # inserted or found by the statements above
    return found[0]
