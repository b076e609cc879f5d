"""Dead-lettered acks: the newest messages of the acker's dead-letter topic, read from Kafka.

Per partition, the last `limit` messages (from the end offset back): what is read is bounded by the
page, whatever the topic holds. No consumer group is joined and nothing is committed. Each message
is an ack entry as it was sent (a failure keeps its '!'), with the reason the acker set it aside.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field

from confluent_kafka import Consumer, TopicPartition

from harvester import logs
from harvester.config import Config

REASON_HEADER = "reason"  # harvester.services.acker.REASON_HEADER
FAILURE_REASON_HEADER = "failure-reason"  # tracker.folding.messages.FAILURE_REASON_HEADER


@dataclass
class DeadAck:
    partition: int
    offset: int
    at: dt.datetime | None
    key: str
    entry: str
    reason: str
    failure_reason: str | None
    source: str  # topic:partition@offset it was read from, where known


@dataclass
class DeadAcks:
    topic: str
    messages: list[DeadAck] = field(default_factory=list)  # newest first
    total: int = 0  # messages the topic still holds (end minus start offsets)
    error: str | None = None


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + data.hex()


def read(cfg: Config, limit: int) -> DeadAcks:
    topic, timeout = cfg.acker.dead_letter_topic, cfg.console.kafka_timeout
    out = DeadAcks(topic)
    conf = {
        "bootstrap.servers": cfg.kafka.bootstrap_servers,
        **cfg.kafka.client,
        "group.id": f"reaper-console-{uuid.uuid4().hex[:8]}",  # never joined: partitions are assigned
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "logger": logs.KafkaLogger("console"),
    }
    consumer = Consumer(conf)
    try:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None:
            return out  # no dead letters yet: the topic is made by the first
        wanted: list[TopicPartition] = []
        for p in sorted(meta.partitions):
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            out.total += high - low
            if high > low:
                wanted.append(TopicPartition(topic, p, max(low, high - limit)))
        if not wanted:
            return out
        consumer.assign(wanted)
        open_parts = {tp.partition for tp in wanted}
        while open_parts:
            msgs = consumer.consume(500, timeout)
            if not msgs:
                break  # Kafka went quiet: show what arrived
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == err._PARTITION_EOF:
                        open_parts.discard(m.partition() or 0)
                    continue
                headers: dict[str, bytes | str | None] = dict(m.headers() or [])
                src = _text(headers.get("source-topic"))
                if headers.get("source-partition") is not None:
                    src += f":{_text(headers.get('source-partition'))}@{_text(headers.get('source-offset'))}"
                kind, ms = m.timestamp()
                at = dt.datetime.fromtimestamp(ms / 1000, dt.UTC) if kind and ms > 0 else None
                out.messages.append(
                    DeadAck(
                        m.partition() or 0,
                        m.offset() or 0,
                        at,
                        _text(m.key()),
                        _text(m.value()),
                        _text(headers.get(REASON_HEADER)),
                        _text(headers.get(FAILURE_REASON_HEADER)) or None,
                        src,
                    )
                )
    except Exception as exc:  # KafkaException or a timeout: say so on the page
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        consumer.close()
    out.messages.sort(key=lambda d: (d.at or dt.datetime.min.replace(tzinfo=dt.UTC), d.offset), reverse=True)
    out.messages = out.messages[:limit]
    return out


__all__ = ["DeadAck", "DeadAcks", "read"]
