"""`outbox.enqueue`: one outbox message per item plus the groups tracking them, in the caller's
transaction, written with binary COPY.

Every row carries the headers `item-id` and `batch-id`. Rows are encoded here straight into
PostgreSQL's binary COPY format (the per-row work is a handful of byte concatenations; the
constant parts of a row are built once per call).
"""
from __future__ import annotations

import json
import struct
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

from psycopg import sql

from .batches import Batch, GroupHandle, batch_id_of, reserve
from .ids import GROUP_BITS_MAX
from .session import DEFAULTS, atomic, pg_connection, schema_of

__all__ = ["Message", "enqueue"]

_int4 = struct.Struct("!i").pack
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\0" + bytes(8)
_NULL = b"\xff\xff\xff\xff"
_TEXT_OID, _BYTEA_OID = 25, 17
_FLUSH_BYTES = 1 << 20
# Decimal spellings of every index a group can hold, shared by every call.
_INDEX_BYTES = [str(i).encode() for i in range(GROUP_BITS_MAX)]

Headers = Mapping[str, "bytes | str"] | Sequence[tuple[str, "bytes | str"]] | None


class Message(NamedTuple):
    """An item with its own key and/or extra headers (plain items take the call's defaults)."""

    value: Any
    key: bytes | str | None = None
    headers: Headers = None


def _value_bytes(value: Any) -> bytes | None:
    if type(value) is bytes:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if value is None:
        return None  # a tombstone
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _key_bytes(key: Any) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    raise TypeError(f"a message key must be bytes, str or None, got {type(key).__name__}")


def _header_pairs(headers: Headers) -> list[tuple[bytes, bytes]]:
    if not headers:
        return []
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    out = []
    for name, value in pairs:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a header name must be a non-empty str, got {name!r}")
        if name in ("item-id", "batch-id"):
            raise ValueError(f"header {name!r} is set by the tracker on every message")
        out.append((name.encode(), value.encode() if isinstance(value, str) else bytes(value)))
    return out


def _field(data: bytes | None) -> bytes:
    return _NULL if data is None else _int4(len(data)) + data


def _array(elements: Sequence[bytes], oid: int) -> bytes:
    """A one-dimensional array without nulls in binary COPY format, as a whole field."""
    body = _int4(1) + _int4(0) + _int4(oid) + _int4(len(elements)) + _int4(1)
    body += b"".join(_int4(len(e)) + e for e in elements)
    return _int4(len(body)) + body


class _RowEncoder:
    """Binary COPY rows (topic, key, value, header_keys, header_values) for one enqueue call."""

    def __init__(self, topic: str, batch_id: int, key: bytes | None, headers: list[tuple[bytes, bytes]]) -> None:
        self.topic = topic.encode()
        self.batch_id = str(batch_id).encode()
        self.headers = headers
        names = [b"item-id", b"batch-id", *(n for n, _ in headers)]
        self.head = b"\x00\x05" + _field(self.topic) + _field(key)
        self.header_keys = _array(names, _TEXT_OID)
        # header_values = [item id, batch id, extra...]: everything after the item id is fixed,
        # and the array's framing depends only on the item id's length.
        self.tail = b"".join(_int4(len(v)) + v for v in (self.batch_id, *(v for _, v in headers)))
        self._framing: dict[int, bytes] = {}

    def framing(self, id_len: int) -> bytes:
        got = self._framing.get(id_len)
        if got is None:
            n = 2 + len(self.headers)
            body_len = 20 + 4 + id_len + len(self.tail)
            got = self._framing[id_len] = (_int4(body_len) + _int4(1) + _int4(0) + _int4(_BYTEA_OID)
                                           + _int4(n) + _int4(1) + _int4(id_len))
        return got

    def header_values(self, handle: GroupHandle) -> list[bytes]:
        """The header_values field of each item of a group, in index order."""
        prefix = b"%d:%d:" % (handle.batch_id, handle.group_id)
        framing, tail, plen = self.framing, self.tail, len(prefix)
        return [framing(plen + len(i)) + prefix + i + tail for i in _INDEX_BYTES[handle.start:handle.upto]]

    def custom_row(self, item: Message, item_id: bytes, default_key: bytes | None) -> bytes:
        """A row with its own key or headers: encoded field by field."""
        key = default_key if item.key is None else _key_bytes(item.key)
        extra = self.headers + _header_pairs(item.headers)
        names = [b"item-id", b"batch-id", *(n for n, _ in extra)]
        values = [item_id, self.batch_id, *(v for _, v in extra)]
        return (b"\x00\x05" + _field(self.topic) + _field(key) + _field(_value_bytes(item.value))
                + _array(names, _TEXT_OID) + _array(values, _BYTEA_OID))


def _copy_sql(schema: str) -> str:
    return sql.SQL("COPY {} (topic, key, value, header_keys, header_values) FROM STDIN (FORMAT BINARY)").format(
        sql.Identifier(schema, DEFAULTS.outbox_table)).as_string(None)


def enqueue(session: Any, batch: Batch | int, items: Iterable[Any], *, topic: str,
            key: bytes | str | Callable[[Any], bytes | str | None] | None = None, headers: Headers = None,
            schema: str | None = None) -> list[GroupHandle]:
    """Write one outbox message per item on `topic` and track the items in `batch`.

    Items are bytes, str, JSON-serialisable values, or `Message(value, key=, headers=)` for a
    per-item key and headers. `key` is the default key (or a function of the item giving it);
    `headers` are added to every message. Returns the groups holding the items, in item order:
    item k of the call is index `start + j` of the group it falls in.
    """
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"topic must be a non-empty string, got {topic!r}")
    batch_id = batch_id_of(batch)
    schema = schema_of(schema)
    items = items if isinstance(items, list) else list(items)
    key_fn = key if callable(key) else None
    default_key = None if key_fn else _key_bytes(key)
    enc = _RowEncoder(topic, batch_id, default_key, _header_pairs(headers))
    # Fast path: plain bytes/str items with no per-item key. Anything else is encoded per row.
    plain = key_fn is None and all(type(v) is bytes or type(v) is str for v in items)
    conn = pg_connection(session)
    with atomic(conn):
        handles = reserve(conn, schema, batch_id, len(items))
        if not items:
            return handles
        with conn.cursor().copy(_copy_sql(schema)) as copy:
            out = bytearray(_COPY_SIGNATURE)
            head, hk = enc.head, enc.header_keys
            pos = 0
            for h in handles:
                hvs = enc.header_values(h)
                chunk = items[pos:pos + len(hvs)]
                if plain:
                    for value, hv in zip(chunk, hvs):
                        if type(value) is str:
                            value = value.encode()
                        out += head
                        out += _int4(len(value))
                        out += value
                        out += hk
                        out += hv
                        if len(out) > _FLUSH_BYTES:
                            copy.write(out)
                            out = bytearray()
                else:
                    prefix = b"%d:%d:" % (h.batch_id, h.group_id)
                    for j, (value, hv) in enumerate(zip(chunk, hvs)):
                        item_key = _key_bytes(key_fn(value)) if key_fn else default_key
                        if isinstance(value, Message) or key_fn:
                            msg = value if isinstance(value, Message) else Message(value)
                            if msg.key is None and item_key is not None:
                                msg = msg._replace(key=item_key)
                            out += enc.custom_row(msg, prefix + _INDEX_BYTES[h.start + j], default_key)
                        else:
                            out += head
                            out += _field(_value_bytes(value))
                            out += hk
                            out += hv
                        if len(out) > _FLUSH_BYTES:
                            copy.write(out)
                            out = bytearray()
                pos += len(hvs)
            out += b"\xff\xff"
            copy.write(out)
        return handles
