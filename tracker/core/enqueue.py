"""The enqueue operation (`tracker.outbox.enqueue`): one outbox message per item plus the groups
tracking them, in the caller's transaction, written with binary COPY.

Every row carries the headers `item-id` and `batch-id`. Rows are encoded here straight into
PostgreSQL's binary COPY format (the per-row work is a handful of byte concatenations; the
constant parts of a row are built once per call).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple, Union

from psycopg import sql

from tracker import tracing
from tracker.core.batches import GroupHandle, batch_id_of, reserve_op
from tracker.core.steps import Op, Write
from tracker.core.validate import check_topic, utf8
from tracker.errors import InvalidArgument, InvalidValue
from tracker.ids import GROUP_BITS_MAX

_int4 = struct.Struct("!i").pack
_COPY_SIGNATURE = b"PGCOPY\n\xff\r\n\0" + bytes(8)
_NULL = b"\xff\xff\xff\xff"
_TEXT_OID, _BYTEA_OID = 25, 17
_FLUSH_BYTES = 1 << 20
# Decimal spellings of every index a group can hold, shared by every call.
_INDEX_BYTES = [str(i).encode() for i in range(GROUP_BITS_MAX)]
_RESERVED_HEADERS = ("item-id", "batch-id")

HeaderValue = Union[bytes, bytearray, memoryview, str]
Headers = Union[Mapping[str, HeaderValue], Sequence[tuple[str, HeaderValue]], None]
Key = Union[bytes, bytearray, memoryview, str, None]
# A JSON-serialisable value (dict, list, number, bool), bytes, str, None (a tombstone) or a Message.
Item = object
KeyArg = Union[Key, Callable[[Item], Key]]


class Message(NamedTuple):
    """An item with its own key and/or extra headers (plain items take the call's defaults)."""

    value: object
    key: Key = None
    headers: Headers = None


def _value_bytes(value: object) -> bytes | None:
    if type(value) is bytes:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return utf8_any(value, "item value")
    if value is None:
        return None  # a tombstone
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidValue("item", value, f"is not bytes, str, None or JSON-serialisable ({exc})") from None


def utf8_any(value: str, name: str) -> bytes:
    """UTF-8 bytes of a str that becomes bytea (NUL is fine there; lone surrogates are not)."""
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidValue(name, value, f"is not valid UTF-8 text ({exc.reason} at {exc.start})") from None


def _key_bytes(key: object) -> bytes | None:
    if key is None or type(key) is bytes:
        return key
    if isinstance(key, str):
        return utf8_any(key, "message key")
    if isinstance(key, (bytes, bytearray, memoryview)):
        return bytes(key)
    raise InvalidArgument("message key", key, "bytes, str or None")


def _header_pairs(headers: object) -> list[tuple[bytes, bytes]]:
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        pairs: Iterable[object] = headers.items()
    elif isinstance(headers, (str, bytes)) or not isinstance(headers, Iterable):
        raise InvalidArgument("headers", headers, "a mapping of name to value, or a list of (name, value) pairs")
    else:
        pairs = headers
    out = []
    for pair in pairs:
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise InvalidArgument("header", pair, "a (name, value) pair")
        name, value = pair
        if not isinstance(name, str) or not name:
            raise InvalidArgument("header name", name, "a non-empty str")
        if name in _RESERVED_HEADERS:
            raise InvalidValue("header name", name, "is set by the tracker on every message")
        if isinstance(value, str):
            raw = utf8_any(value, f"header {name!r} value")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            raw = bytes(value)
        else:
            raise InvalidArgument(f"header {name!r} value", value, "bytes or str")
        out.append((utf8(name, "header name"), raw))
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
            got = self._framing[id_len] = (
                _int4(body_len) + _int4(1) + _int4(0) + _int4(_BYTEA_OID) + _int4(n) + _int4(1) + _int4(id_len)
            )
        return got

    def header_values(self, handle: GroupHandle) -> list[bytes]:
        """The header_values field of each item of a group, in index order."""
        prefix = b"%d:%d:" % (handle.batch_id, handle.group_id)
        framing, tail, plen = self.framing, self.tail, len(prefix)
        return [framing(plen + len(i)) + prefix + i + tail for i in _INDEX_BYTES[handle.start : handle.upto]]

    def custom_row(self, item: Message, item_id: bytes, default_key: bytes | None) -> bytes:
        """A row with its own key or headers: encoded field by field."""
        key = default_key if item.key is None else _key_bytes(item.key)
        extra = self.headers + _header_pairs(item.headers)
        names = [b"item-id", b"batch-id", *(n for n, _ in extra)]
        values = [item_id, self.batch_id, *(v for _, v in extra)]
        return (
            b"\x00\x05"
            + _field(self.topic)
            + _field(key)
            + _field(_value_bytes(item.value))
            + _array(names, _TEXT_OID)
            + _array(values, _BYTEA_OID)
        )


@functools.lru_cache(maxsize=64)
def statements(schema: str, outbox_table: str) -> tuple[str, str]:
    """(binary COPY, one-row INSERT) into the outbox table."""
    table = sql.Identifier(schema, outbox_table)
    copy = sql.SQL("COPY {} (topic, key, value, header_keys, header_values) FROM STDIN (FORMAT BINARY)")
    insert = sql.SQL("INSERT INTO {} (topic, key, value, header_keys, header_values) VALUES (%s, %s, %s, %s, %s)")
    return copy.format(table).as_string(None), insert.format(table).as_string(None)


def _item_list(items: object) -> list[Item]:
    if isinstance(items, list):
        return items
    if (
        items is None
        or isinstance(items, (str, bytes, bytearray, memoryview, Mapping, int, float))
        or not isinstance(items, Iterable)
    ):
        raise InvalidArgument("items", items, "a list or iterable of items (bytes, str, JSON values or Message)")
    return list(items)


class _Call(NamedTuple):
    enc: _RowEncoder
    handles: list[GroupHandle]
    items: list[Item]
    key_fn: Callable[[Item], Key] | None
    default_key: bytes | None

    def groups(self) -> Iterator[tuple[GroupHandle, list[Item]]]:
        pos = 0
        for h in self.handles:
            yield h, self.items[pos : pos + h.count]
            pos += h.count

    def copy_chunks(self) -> Iterator[bytes]:
        """The binary COPY payload, in chunks of about 1 MiB."""
        enc = self.enc
        head, hk = enc.head, enc.header_keys
        plain = self.key_fn is None and all(type(v) is bytes or type(v) is str for v in self.items)
        out = bytearray(_COPY_SIGNATURE)
        for h, chunk in self.groups():
            hvs = enc.header_values(h)
            if plain:
                for value, hv in zip(chunk, hvs):
                    raw = utf8_any(value, "item value") if type(value) is str else value
                    assert isinstance(raw, bytes)  # `plain`: every item is bytes or str
                    out += head
                    out += _int4(len(raw))
                    out += raw
                    out += hk
                    out += hv
                    if len(out) > _FLUSH_BYTES:
                        yield bytes(out)
                        out = bytearray()
                continue
            prefix = b"%d:%d:" % (h.batch_id, h.group_id)
            for j, (value, hv) in enumerate(zip(chunk, hvs)):
                if isinstance(value, Message) or self.key_fn:
                    out += enc.custom_row(self._message(value), prefix + _INDEX_BYTES[h.start + j], self.default_key)
                else:
                    out += head
                    out += _field(_value_bytes(value))
                    out += hk
                    out += hv
                if len(out) > _FLUSH_BYTES:
                    yield bytes(out)
                    out = bytearray()
        out += b"\xff\xff"
        yield bytes(out)

    def _message(self, value: Item) -> Message:
        msg = value if isinstance(value, Message) else Message(value)
        if msg.key is None and self.key_fn:
            msg = msg._replace(key=self.key_fn(value))
        return msg

    def insert_rows(self) -> Iterator[tuple[str, bytes | None, bytes | None, list[str], list[bytes]]]:
        """The same rows as parameters of a plain INSERT (pipeline mode, where COPY is refused)."""
        enc = self.enc
        topic = enc.topic.decode()
        for h, chunk in self.groups():
            prefix = b"%d:%d:" % (h.batch_id, h.group_id)
            for j, value in enumerate(chunk):
                msg = self._message(value)
                key = self.default_key if msg.key is None else _key_bytes(msg.key)
                extra = enc.headers + _header_pairs(msg.headers)
                names = ["item-id", "batch-id", *(n.decode() for n, _ in extra)]
                values = [prefix + _INDEX_BYTES[h.start + j], enc.batch_id, *(v for _, v in extra)]
                yield topic, key, _value_bytes(msg.value), names, values


COLUMNS = ("topic", "key", "value", "header_keys", "header_values")


def enqueue_op(
    q: dict[str, str],
    copy_sql: str,
    insert_sql: str,
    batch: object,
    items: object,
    topic: object,
    key: object,
    headers: object,
    target: tuple[str, str] = ("", ""),
) -> Op[list[GroupHandle]]:
    batch_id = batch_id_of(batch)  # type: ignore[arg-type]
    check_topic(topic)
    item_list = _item_list(items)
    key_fn = key if callable(key) else None
    default_key = None if key_fn else _key_bytes(key)
    pairs = _header_pairs(headers)
    pairs += tracing.outbox_headers([n for n, _ in pairs])  # the active span's W3C context, if any
    enc = _RowEncoder(topic, batch_id, default_key, pairs)  # type: ignore[arg-type]
    for value in item_list:  # per-item keys and headers are checked before anything is written
        if isinstance(value, Message):
            _key_bytes(value.key)
            _header_pairs(value.headers)
    handles = yield from reserve_op(q, batch_id, len(item_list), last=not item_list)
    if not item_list:
        return handles
    call = _Call(enc, handles, item_list, key_fn, default_key)
    yield Write(copy_sql, call.copy_chunks, insert_sql, call.insert_rows, target[0], target[1], COLUMNS)
    return handles
