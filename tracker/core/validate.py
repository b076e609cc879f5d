"""Checks of the caller's input, before anything is sent: typed errors that name the value as the
caller wrote it. Nothing here allocates in proportion to an untrusted number."""

from __future__ import annotations

import re
from collections.abc import Iterable

from tracker.errors import InvalidArgument, InvalidValue

# One call adds at most this many items: 131,072 groups, 128 MiB of bitfields. Larger fan-outs
# are several calls (or Spark's fan_out); the bound is checked before anything is allocated.
MAX_ITEMS_PER_CALL = 1 << 30
# Kafka's own rules for a topic name: at most 249 characters of ASCII letters, digits, '.', '_'
# and '-', and not '.' or '..'. A name it refuses is refused here, at the call, rather than found
# out by the harvester, which could only move the row to the dead table.
TOPIC_MAX = 249
TOPIC_CHARS = re.compile(r"[A-Za-z0-9._-]+")
# Topics the broker keeps for itself (consumer offsets, transactions, share groups, its metadata
# log, tiered storage's metadata): valid names that it refuses to every producer, so a row naming
# one could never be published. Other names starting with '__' are topics like any other (the
# reaper's own leader topic is `__reaper_leader`).
KAFKA_INTERNAL_TOPICS = frozenset(
    {"__consumer_offsets", "__transaction_state", "__share_group_state", "__cluster_metadata", "__remote_log_metadata"}
)
# A batch's user key is stored and indexed (sql/0019_batch_user_key.sql): a Postgres index entry
# holds at most about 2.7 kB, so the key is capped in characters (as the HTTP API always was) and
# in UTF-8 bytes (1,000 characters of other scripts take up to 4,000).
USER_KEY_MAX = 1000
USER_KEY_MAX_BYTES = 2000


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


def is_topic_name(topic: object) -> bool:
    """True when Kafka accepts `topic` as the name of a topic producers write to (check_topic's
    rule, without raising): not one of KAFKA_INTERNAL_TOPICS."""
    return (
        isinstance(topic, str)
        and 0 < len(topic) <= TOPIC_MAX
        and TOPIC_CHARS.fullmatch(topic) is not None
        and topic not in (".", "..")
        and topic not in KAFKA_INTERNAL_TOPICS
    )


def check_topic(topic: object, name: str = "topic") -> str:
    if not isinstance(topic, str):
        raise InvalidArgument(name, topic, "a non-empty str")
    if not topic:
        raise InvalidValue(name, topic, "must be a non-empty string")
    utf8(topic, name)
    if len(topic) > TOPIC_MAX:
        raise InvalidValue(name, topic, f"is longer than Kafka's {TOPIC_MAX} characters")
    if topic in KAFKA_INTERNAL_TOPICS:
        raise InvalidValue(name, topic, "is one of Kafka's internal topics, which producers may not write")
    if not is_topic_name(topic):
        raise InvalidValue(
            name, topic, "is not a Kafka topic name (ASCII letters, digits, '.', '_' and '-' only; not '.' or '..')"
        )
    return topic


def optional_text(value: object, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument(name, value, "a str or None")
    utf8(value, name)
    return value


def check_user_key(value: object, name: str = "user_key") -> str | None:
    key = optional_text(value, name)
    if key is None:
        return None
    if len(key) > USER_KEY_MAX:
        raise InvalidValue(name, key, f"is longer than {USER_KEY_MAX} characters ({len(key)})")
    size = len(key.encode("utf-8"))
    if size > USER_KEY_MAX_BYTES:
        raise InvalidValue(name, key, f"is longer than {USER_KEY_MAX_BYTES} bytes in UTF-8 ({size})")
    return key


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


# A failure reason is stored once per text (sql/0016_outcomes.sql) and capped: longer is refused,
# never cut (the caller's value is what is stored).
REASON_MAX = 500


def check_reason(reason: object, name: str = "reason") -> str:
    if not isinstance(reason, str):
        raise InvalidArgument(name, reason, f"a non-empty str of at most {REASON_MAX} characters")
    if not reason:
        raise InvalidValue(name, reason, "must be a non-empty string")
    utf8(reason, name)
    if len(reason) > REASON_MAX:
        raise InvalidValue(name, reason, f"is longer than {REASON_MAX} characters ({len(reason)})")
    return reason


def check_thresholds(tolerated_failures: object, tolerated_failure_ratio: object) -> tuple[int | None, float | None]:
    n, r = tolerated_failures, tolerated_failure_ratio
    if n is not None:
        if not isinstance(n, int) or isinstance(n, bool):
            raise InvalidArgument("tolerated_failures", n, "an int >= 0 or None")
        if not 0 <= n <= (1 << 63) - 1:
            raise InvalidValue("tolerated_failures", n, "must be between 0 and 2**63 - 1")
    if r is not None:
        if not isinstance(r, (int, float)) or isinstance(r, bool):
            raise InvalidArgument("tolerated_failure_ratio", r, "a number from 0 to 1 or None")
        if not 0 <= r <= 1:  # NaN fails this too
            raise InvalidValue("tolerated_failure_ratio", r, "must be between 0 and 1")
        r = float(r)
    return n, r
