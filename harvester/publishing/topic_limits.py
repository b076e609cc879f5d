"""A topic's `max.message.bytes`, asked of the brokers once a batch is refused as too large.

A topic's limit may be smaller than the producer's own `message.max.bytes` (which produce()
enforces: a record over it is moved to the dead table at once). A batch between the two is taken
by produce() and refused by the broker with MSG_SIZE_TOO_LARGE, failing the request (and, under
the gap-less guarantee, the producer); which record of it the topic can never take, its size
cannot tell (the broker judges the compressed batch). So the rows are published again until the
operator acts, and the settler's error line names the topic's limit and the setting that makes
produce() refuse such records itself. The limit is asked (describe_configs) on the settling thread,
and kept for LIMIT_TTL seconds.
"""

from __future__ import annotations

import logging
import threading
import time

from confluent_kafka.admin import AdminClient, ConfigResource

LIMIT_TTL = 60.0  # seconds a topic's max.message.bytes is trusted once read
LOOKUP_TIMEOUT = 5.0
CLIENT_DEFAULT = 1_000_000  # librdkafka's message.max.bytes

_quiet = logging.getLogger("reaper.kafka.topic-limits")
_quiet.addHandler(logging.NullHandler())
_quiet.propagate = False  # the producer's own settings, unknown to an admin client, warn at creation


class TopicLimits:
    """Topics' `max.message.bytes`, read from the brokers with the producer's own settings."""

    def __init__(self, producer_conf: dict) -> None:
        self._conf = {
            k: v
            for k, v in producer_conf.items()
            if k not in ("error_cb", "logger", "on_delivery", "transactional.id") and not callable(v)
        }
        self.producer_limit = int(producer_conf.get("message.max.bytes", CLIENT_DEFAULT))
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
        except Exception:  # brokers away, no DescribeConfigs right: the line says the limit is unknown
            limit = None
        with self._lock:
            self._known[topic] = (limit, now + (LIMIT_TTL if limit is not None else 5.0))
        return limit
