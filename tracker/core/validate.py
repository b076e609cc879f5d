"""Checks of the caller's input, before anything is sent: typed errors that name the value as the
caller wrote it. Nothing here allocates in proportion to an untrusted number."""

from __future__ import annotations

from collections.abc import Iterable

from tracker.errors import InvalidArgument, InvalidValue

# One call adds at most this many items: 131,072 groups, 128 MiB of bitfields. Larger fan-outs
# are several calls (or Spark's fan_out); the bound is checked before anything is allocated.
MAX_ITEMS_PER_CALL = 1 << 30
# Kafka's own limit on a topic name's length.
TOPIC_MAX = 249


def check_count(n: object, name: str = "n") -> int:
    if not isinstance(n, int) or isinstance(n, bool):
        raise InvalidArgument(name, n, "an int")
    if n < 0:
        raise InvalidValue(name, n, "the number of items must be >= 0")
    if n > MAX_ITEMS_PER_CALL:
        raise InvalidValue(name, n, f"one call adds at most {MAX_ITEMS_PER_CALL:,} items; split it into several calls")
    return n


def utf8(value: str, name: str) -> bytes:
    """`value` as UTF-8 without NUL (Postgres text holds neither NUL nor lone surrogates)."""
    if "\x00" in value:
        raise InvalidValue(name, value, "contains a NUL character, which Postgres text cannot hold")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidValue(name, value, f"is not valid UTF-8 text ({exc.reason} at {exc.start})") from None


def check_topic(topic: object, name: str = "topic") -> str:
    if not isinstance(topic, str):
        raise InvalidArgument(name, topic, "a non-empty str")
    if not topic:
        raise InvalidValue(name, topic, "must be a non-empty string")
    utf8(topic, name)
    if len(topic) > TOPIC_MAX:
        raise InvalidValue(name, topic, f"is longer than Kafka's {TOPIC_MAX} characters")
    return topic


def optional_text(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(name, value, "a str or None")
    utf8(value, name)
    return value


def id_list(item_ids: object, name: str = "item_ids") -> list[str | bytes]:
    """The ids argument: one str/bytes id or run, or an iterable of them (not a dict or a number)."""
    if isinstance(item_ids, (str, bytes)):
        return [item_ids]
    if (
        item_ids is None
        or isinstance(item_ids, (int, float, dict, bytearray, memoryview))
        or not isinstance(item_ids, Iterable)
    ):
        raise InvalidArgument(name, item_ids, "an item id (str or bytes) or a list/iterable of them")
    return item_ids if isinstance(item_ids, list) else list(item_ids)
