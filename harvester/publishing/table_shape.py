"""The columns an outbox table must have, with types the harvester can publish, checked before it marks.

`reaper migrate` makes tables of this shape; an application's own table (harvester.outboxes, as
`CREATE TABLE ... (LIKE outbox INCLUDING ALL)` makes one) may differ. A column missing, or of a
type the publishing path cannot carry (a `text` key: partitions are chosen from the key's bytes;
a `jsonb` value: Kafka takes bytes), would otherwise stop the producing thread on the first row
with an error that names neither the table nor the column. Domains count as their base type.
"""

from __future__ import annotations

import psycopg

_INTEGER = frozenset({"smallint", "integer", "bigint"})
_TEXT = frozenset({"text", "character varying", "character", "name"})

# column: (the base types accepted, how the refusal names them)
EXPECTED: dict[str, tuple[frozenset[str], str]] = {
    "id": (_INTEGER, "bigint"),
    "created_at": (
        frozenset({"timestamp with time zone", "timestamp without time zone", "date"}),
        "timestamptz, timestamp or date",
    ),
    "topic": (_TEXT, "text"),
    "key": (frozenset({"bytea"}), "bytea"),
    "value": (frozenset({"bytea"}) | _TEXT, "bytea (or text)"),
    "header_keys": (frozenset(f"{t}[]" for t in _TEXT), "text[]"),
    "header_values": (frozenset({"bytea[]"}), "bytea[]"),
    "kafka_partition": (_INTEGER, "integer"),
    "leader_id": (frozenset({"uuid"}), "uuid"),
}

# Each column's type, a domain read as its base type (an array of a domain as the domain's array).
_COLUMNS = """
SELECT a.attname::text,
       format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END, NULL)
  FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
 WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
"""


class OutboxShapeRefused(RuntimeError):
    """The outbox table lacks a column the harvester needs, or has one of a type it cannot publish."""


def check_shape(conn: psycopg.Connection, table: str) -> None:
    """Raise OutboxShapeRefused naming every column of `table` (a quoted, qualified name) that is
    missing or of another type than EXPECTED says; nothing when the table does not exist (the mark
    says so)."""
    found: dict[str, str] = {name: kind for name, kind in conn.execute(_COLUMNS, [table]).fetchall()}
    if not found:
        return
    wrong = []
    for column, (accepted, wanted) in EXPECTED.items():
        have = found.get(column)
        if have is None:
            wrong.append(f"{column} is missing (want {wanted})")
        elif have not in accepted:
            wrong.append(f"{column} is {have} (want {wanted})")
    if wrong:
        raise OutboxShapeRefused(
            f"outbox table {table} cannot be published: " + "; ".join(wrong) + ". A table made by `reaper migrate`, "
            "or as CREATE TABLE ... (LIKE <schema>.outbox INCLUDING ALL), has every column the reaper needs"
        )
