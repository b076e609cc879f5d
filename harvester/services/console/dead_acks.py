"""Dead-lettered acks: the newest messages of the acker's dead-letter topic, read from Kafka.

Per partition, the last `limit` messages (from the end offset back): what is read is bounded by the
page, whatever the topic holds. No consumer group is joined and nothing is committed. Each message
is an ack entry as it was sent (a failure keeps its '!'), with the reason the acker set it aside;
an operator may send chosen ones to the ack topic again (harvester.admin.acks, `reaper acks requeue`).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

from confluent_kafka import TopicPartition

from harvester.admin.acks import DeadAck, consumer, dead_ack
from harvester.config import Config


@dataclass
class DeadAcks:
    topic: str
    messages: list[DeadAck] = field(default_factory=list)  # newest first
    total: int = 0  # messages the topic still holds (end minus start offsets)
    error: str | None = None


def read(cfg: Config, limit: int) -> DeadAcks:
    topic, timeout = cfg.acker.dead_letter_topic, cfg.console.kafka_timeout
    out = DeadAcks(topic)
    c = consumer(cfg, "console")
    try:
        meta = c.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None:
            return out  # no dead letters yet: the topic is made by the first
        wanted: list[TopicPartition] = []
        for p in sorted(meta.partitions):
            low, high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)
            out.total += high - low
            if high > low:
                wanted.append(TopicPartition(topic, p, max(low, high - limit)))
        if not wanted:
            return out
        c.assign(wanted)
        open_parts = {tp.partition for tp in wanted}
        while open_parts:
            msgs = c.consume(500, timeout)
            if not msgs:
                break  # Kafka went quiet: show what arrived
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() == err._PARTITION_EOF:
                        open_parts.discard(m.partition() or 0)
                    continue
                out.messages.append(dead_ack(m))
    except Exception as exc:  # KafkaException or a timeout: say so on the page
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        c.close()
    out.messages.sort(key=lambda d: (d.at or dt.datetime.min.replace(tzinfo=dt.UTC), d.offset), reverse=True)
    out.messages = out.messages[:limit]
    return out


__all__ = ["DeadAck", "DeadAcks", "read"]
