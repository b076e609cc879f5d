"""Message ids: the `message-id` header the harvester puts on every record it publishes.

The id is `<namespace>:<row id>:<created>`, ASCII, at most 78 characters: the namespace is a random
UUID stored once per outbox table in `<schema>.outbox_namespace` (sql/0017_message_id.sql), the row
id and `created` (its `created_at` in microseconds since the Unix epoch) are the outbox row's. A
row id comes again when the table's sequence goes back (TRUNCATE ... RESTART IDENTITY, setval, an
older backup restored, a standby promoted without the last commits), but the row that takes it was
created later, so its id differs: ids never repeat. And every publication of one row (a reset, a
remark, a new leader, a promoted standby, a restored backup) gives the same id: the namespace and
`created_at` are rows and columns like any other, replicated and kept. Rows written by any
language, or by the tracker's own SQL (completion and expiry events), get it alike: the harvester
builds it in the mark's RETURNING (MESSAGE_ID_SQL); nothing is stored per row.

Upgrades: rows created before the namespace's `suffix_from` (sql/0022_message_id_created.sql: the
time that migration ran, for the tables that had a namespace then) keep the previous versions'
`<namespace>:<row id>`, so a row published before the upgrade is the same message when published
again after it. Namespaces registered later have -infinity: every row gets the new form; so have
those of a namespace table created in the same run as that migration (a fresh install, a schema
that had no namespace table: no earlier version published an id from it, and a row whose
`created_at` the application dated before the cutover would keep a short id that comes again).

The header comes last, after the row's own headers; `message_id_of` reads the last one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from psycopg.adapt import AdaptersMap, Dumper
from psycopg.postgres import types as pg_types
from psycopg.pq import Format
from psycopg.rows import tuple_row
from psycopg.types.numeric import Int8BinaryLoader

from tracker import schema as schema_mod
from tracker.config import DEFAULT_OUTBOX_TABLE
from tracker.errors import InvalidValue, TrackerError
from tracker.schema import check_identifier, qualified

MESSAGE_ID_HEADER = "message-id"
MESSAGE_ID_MAX = 100  # the documented bound on the header's length (ids are at most 78 characters)
# sql/0017_message_id.sql creates NAMESPACE_TABLE, sql/0022_message_id_created.sql adds its suffix_from column
NAMESPACE_TABLE, NAMESPACE_MIGRATION, SUFFIX_MIGRATION = (
    schema_mod.NAMESPACE_TABLE,
    schema_mod.NAMESPACE_MIGRATION,
    schema_mod.SUFFIX_MIGRATION,
)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
PG_EPOCH_US = 946_684_800_000_000  # Postgres stores a timestamptz as int8 microseconds since 2000-01-01 UTC
INT8_MIN, INT8_MAX = -(2**63), 2**63 - 1
ALL_ROWS = INT8_MIN + PG_EPOCH_US  # Namespace.suffix_from when every row gets the new form (-infinity)


def load_timestamps_as_micros(adapters: AdaptersMap) -> None:
    """Make the cursor or connection whose `adapters` these are load binary timestamptz values as
    Postgres's own int8, decoded in C like any int8 (no datetime, no work in the database): add
    PG_EPOCH_US for microseconds since the Unix epoch. -infinity and infinity load as INT8_MIN and
    INT8_MAX. What `namespace` reads `suffix_from` with."""
    adapters.register_loader("timestamptz", Int8BinaryLoader)


def micros(at: datetime) -> int:
    """`at` in microseconds since the Unix epoch: in SQL `extract(epoch FROM at) * 1000000`: what a
    row's `created_at` counts as in its message id. Raises InvalidValue for a naive datetime
    (no time zone: which instant it is is unknown)."""
    if not isinstance(at, datetime) or at.utcoffset() is None:
        raise InvalidValue("created_at", at, "must be a datetime with a time zone")
    return (at - EPOCH) // timedelta(microseconds=1)


@dataclass(frozen=True, slots=True)
class Namespace:
    """An outbox table's message-id namespace: its UUID, and from when (microseconds since the Unix
    epoch; ALL_ROWS: always) its rows' ids end with their `created_at`."""

    uuid: uuid.UUID
    suffix_from: int = ALL_ROWS

    @property
    def prefix(self) -> str:
        """What every id of the table starts with (bound into the mark: MESSAGE_ID_SQL)."""
        return f"{self.uuid}:"

    def message_id(self, row_id: int, created_us: int) -> str:
        """The id of row `row_id` created at `created_us` (microseconds since the Unix epoch); the
        harvester's mark builds the same in SQL (MESSAGE_ID_SQL)."""
        if created_us >= self.suffix_from:
            return f"{self.uuid}:{row_id}:{created_us}"
        return f"{self.uuid}:{row_id}"


class Micros2000(int):
    """A timestamptz bound as Postgres's own int8 (µs since 2000-01-01 UTC; INT8_MIN and INT8_MAX
    are -infinity and infinity): exact for every value Postgres can hold, as no datetime is."""


class _Micros2000Dumper(Dumper):
    format = Format.BINARY
    oid = pg_types["timestamptz"].oid

    def dump(self, obj: Any) -> bytes:
        return int(obj).to_bytes(8, "big", signed=True)


def bind_micros2000(adapters: AdaptersMap) -> None:
    """Let the cursor or connection whose `adapters` these are bind Micros2000 values."""
    adapters.register_dumper(Micros2000, _Micros2000Dumper)


# A marked row's message id, built by Postgres in the mark's RETURNING (harvester.publishing.outbox_sql)
# from the row's `id` and `created_at` and two parameters, `message_id_params`: the same text as
# Namespace.message_id for every row. created_at as Postgres stores it (timestamptz_send: its int8,
# ±infinity at the ends) plus PG_EPOCH_US in numeric, which cannot overflow at the ends of int8; a
# NULL created_at as -infinity. The how-to's query for the inbox (docs/howto/inbox.md) is the same.
MESSAGE_ID_SQL = (
    "%(mid_prefix)s::text || id || CASE WHEN coalesce(created_at, '-infinity') >= %(mid_cut)s THEN ':' || "
    "(('x' || encode(timestamptz_send(coalesce(created_at, '-infinity')), 'hex'))::bit(64)::bigint::numeric"
    f" + {PG_EPOCH_US})::text ELSE '' END"
)


# The first finite timestamptz and the first past the last (µs since 2000): Postgres refuses between
# them and ±infinity, where a cut means the same as at that end.
FIRST_US2000, END_US2000 = -211_813_488_000_000_000, 9_223_371_331_200_000_000


def message_id_params(ns: Namespace) -> dict[str, object]:
    """MESSAGE_ID_SQL's parameters for `ns` (bound, never SQL text; the cursor needs bind_micros2000).
    Raises InvalidValue for a suffix_from after infinity (a namespace read from the database never has one)."""
    cut = ns.suffix_from - PG_EPOCH_US
    if cut > INT8_MAX:
        raise InvalidValue("suffix_from", ns.suffix_from, "must be at most infinity's µs since the Unix epoch")
    if cut <= INT8_MIN:
        cut = INT8_MIN
    elif cut < FIRST_US2000:
        cut = FIRST_US2000  # only -infinity lies before it
    elif cut >= END_US2000:
        cut = INT8_MAX  # only infinity lies at or after it
    return {"mid_prefix": ns.prefix, "mid_cut": Micros2000(cut)}


class NamespaceUnavailable(TrackerError, LookupError):
    """The schema has no namespace table (not migrated to this version) or the outbox table does not exist."""

    def __init__(
        self, schema: str, table: str, detail: str, *, missing_table: bool = False, advice: str = "run `reaper migrate`"
    ) -> None:
        self.schema, self.table = schema, table
        self.missing_table = missing_table  # the schema has no namespace table (tracker.message_ids.create_table)
        super().__init__(f"no message-id namespace for {schema}.{table}: {detail}" + (f" ({advice})" if advice else ""))


def message_id(namespace: Namespace, row_id: int, created_at: datetime | int) -> str:
    """The message id of outbox row `row_id`, created at `created_at` (the row's column, or it in
    microseconds since the Unix epoch), of the table whose namespace is `namespace` (see `namespace`)."""
    return namespace.message_id(row_id, created_at if isinstance(created_at, int) else micros(created_at))


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


def namespace(conn: psycopg.Connection, schema: str, table: str = DEFAULT_OUTBOX_TABLE) -> Namespace:
    """The namespace of `schema.table`'s message ids. A table the migrations did not create gets
    one the first time (several processes at once agree on one), whose rows all get the new form.
    Runs in `conn`'s transaction (never commits it; a failure leaves it as it was: the statements
    run in a savepoint), with any row factory; the harvester calls it in autocommit. Raises
    NamespaceUnavailable (missing_table when the schema's namespace table is missing or predates
    sql/0022_message_id_created.sql)."""
    names = {"ns": qualified(schema, NAMESPACE_TABLE)}
    table_name = qualified(schema, check_identifier(table, "outbox table")).as_string(conn)
    read = sql.SQL("SELECT namespace, suffix_from FROM {ns} WHERE outbox = to_regclass(%s)").format(**names)
    if not conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        # Open the caller's implicit transaction first: a transaction() block entered outside one
        # would BEGIN and COMMIT a transaction of its own, which the caller could not roll back.
        conn.execute("SELECT 1")
    try:
        # A savepoint in the caller's transaction (a transaction of its own in autocommit): a
        # failed statement must not leave the caller's transaction aborted.
        with conn.transaction(), conn.cursor(row_factory=tuple_row, binary=True) as cur:
            load_timestamps_as_micros(cur.adapters)
            found = cur.execute(read, [table_name]).fetchone()
            if found is None:
                if cur.execute("SELECT to_regclass(%s)", [table_name]).fetchone() == (None,):
                    # says what would make it: `reaper migrate` makes only its own outbox table
                    raise NamespaceUnavailable(schema, table, schema_mod.missing_table(schema, table), advice="")
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
    except psycopg.errors.UndefinedColumn as exc:
        detail = f"{schema}.{NAMESPACE_TABLE} predates migration {SUFFIX_MIGRATION:04d}"
        raise NamespaceUnavailable(schema, table, detail, missing_table=True) from exc
    assert found is not None  # inserted or found by the statements above
    return Namespace(found[0], found[1] + PG_EPOCH_US)


def create_table(conn: psycopg.Connection, schema: str) -> None:
    """Create `schema`'s namespace table when it has none (an outbox in a schema `reaper migrate`
    never ran in), or add its suffix_from column, as migrations 0017 and 0022 do (both are
    idempotent), under the migration's advisory lock so a concurrent `reaper migrate` queues. Needs
    an autocommit connection (it commits its own transaction). Raises NamespaceUnavailable, naming
    the statements to run, when the role may not."""
    texts = {m.version: m.text for m in schema_mod.migrations() if m.version in (NAMESPACE_MIGRATION, SUFFIX_MIGRATION)}
    for version in (NAMESPACE_MIGRATION, SUFFIX_MIGRATION):
        if version not in texts:
            raise RuntimeError(f"migration {version:04d} is missing from this installation")
    text = texts[NAMESPACE_MIGRATION] + "\n" + texts[SUFFIX_MIGRATION]
    path = sql.Identifier(check_identifier(schema, "schema")).as_string(conn)
    try:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", [schema_mod.migration_lock_key(schema)])
            conn.execute("SELECT set_config('search_path', %s, true)", [path])
            fresh = conn.execute("SELECT to_regclass('outbox_namespace') IS NULL").fetchone() == (True,)
            conn.execute(text)
            if fresh:  # no earlier version published from this schema: no row keeps the short id
                conn.execute(schema_mod.NO_CUTOVER)
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.InvalidSchemaName) as exc:
        raise NamespaceUnavailable(
            schema,
            NAMESPACE_TABLE,
            f"this role cannot create it ({exc}); have the schema's owner run:\nSET search_path TO {path};\n{text}",
        ) from None
    except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable):
        pass  # created at the same moment by a session that does not take the lock
