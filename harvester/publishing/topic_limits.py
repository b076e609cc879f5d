"""Which record a topic refuses for its size, once the brokers have refused a batch for it.

A topic's `max.message.bytes` may be smaller than the producer's own `message.max.bytes` (which
produce() enforces, so a record over it is moved aside at once). A record between the two is
taken by produce() and refused by the broker with MSG_SIZE_TOO_LARGE, which fails the whole
request batch it travelled in, and under the gap-less guarantee the producer too: the rows of the
batch are reset and published again, each with a report of its own (DeliverySettler.single). A
record whose report says MSG_SIZE_TOO_LARGE and which alone is larger than the topic's limit can
never be written: it is moved to the dead table (`too_large`); the others of its batch are not.

The limit is asked of the brokers (describe_configs) only then, on the settling thread, and kept
for LIMIT_TTL seconds.
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka.admin import AdminClient, ConfigResource

# A record batch's framing (61 bytes) and one record's (length, attributes, deltas: up to ~21).
RECORD_OVERHEAD = 82
LIMIT_TTL = 60.0  # seconds a topic's max.message.bytes is trusted once read
LOOKUP_TIMEOUT = 5.0

_quiet = logging.getLogger("reaper.kafka.topic-limits")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False  # the producer's own settings, unknown to an admin client, warn at creation


def record_size(msg: object) -> int:
    """What a consumed or reported record weighs in a batch of its own: key, value, headers."""
    size = RECORD_OVERHEAD
    for part in (msg.key(), msg.value()):  # type: ignore[attr-defined]
        if part is not None:
            size += len(part)
    for name, value in msg.headers() or ():  # type: ignore[attr-defined]
        size += len(name.encode()) + (len(value) if value is not None else 0)
    return size


class TopicLimits:
    """Topics' `max.message.bytes`, read from the brokers with the producer's own settings."""

    def __init__(self, producer_conf: dict) -> None:
        self._conf = {
            k: v
            for k, v in producer_conf.items()
            if k not in ("error_cb", "logger", "on_delivery", "transactional.id") and not callable(v)
        }
        self._admin: AdminClient | None = None
        self._known: dict[str, tuple[int | None, float]] = {}
        self._lock = threading.Lock()

    def of(self, topic: str) -> int | None:
        """The topic's max.message.bytes, or None when the brokers could not say."""
        now = time.monotonic()
        with self._lock:
            known = self._known.get(topic)
            if known is not None and now < known[1]:
                return known[0]
            if self._admin is None:
                self._admin = AdminClient({**self._conf, "logger": _quiet})  # type: ignore[dict-item]
            admin = self._admin
        limit: int | None = None
        try:
            resource = ConfigResource(ConfigResource.Type.TOPIC, topic)
            configs = admin.describe_configs([resource], request_timeout=LOOKUP_TIMEOUT)[resource].result(
                timeout=LOOKUP_TIMEOUT + 1
            )
            entry = configs.get("max.message.bytes")
            limit = int(entry.value) if entry is not None and entry.value is not None else None
        except Exception:  # brokers away, no Describe right: the record is only published again
            limit = None
        with self._lock:
            self._known[topic] = (limit, now + (LIMIT_TTL if limit is not None else 5.0))
        return limit

    def too_large(self, topic: str, size: int) -> int | None:
        """The topic's limit when a record of `size` bytes is over it, else None."""
        limit = self.of(topic)
        return limit if limit is not None and size > limit else None
