"""`reaper acks requeue`: send dead-lettered acks back to the ack topic.

The acker sets aside ack messages it cannot apply (malformed ids, unknown batches or groups, indexes
past a group's size, acks of expired batches) on its dead-letter topic, each as the entry it was
sent (a failure keeps its '!' and its failure-reason header) with the reason in a `reason` header.
Once the cause is fixed, this produces chosen ones again, each to the ack topic it came from (its
source-topic header: every schema's acker shares the dead-letter topic): one message named by
its partition and offset (`--at P:O`), or every message whose reason contains a text (`--reason`),
or every message (`--all`), among the newest `--scan` of each partition (older ones are counted,
not read). Kafka keeps the dead letters: a message requeued twice is sent twice, and the second
is a duplicate ack, which changes nothing. Each requeue is recorded in `admin_log`.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from psycopg import sql

from harvester import logs
from harvester.admin.common import AdminError, require_tables
from harvester.config import Config, ack_topics
from harvester.exit_codes import ExitCode
from harvester.kafka_delivery import Headers, Record, produce_all
from tracker.schema import qualified

REASON_HEADER = "reason"  # harvester.services.ack_dead_letters.REASON_HEADER
FAILURE_REASON_HEADER = "failure-reason"  # tracker.folding.messages.FAILURE_REASON_HEADER
TRUNCATED_HEADER = "truncated"  # harvester.services.ack_dead_letters.TRUNCATED_HEADER
REQUEUED_FROM_HEADER = "requeued-from"  # dead-letter topic:partition@offset a requeued ack came from
SCAN = 10_000  # newest dead letters of each partition a --reason or --all requeue looks at
HELD_BYTES_MAX = 256 * 2**20  # keys, values and headers of the chosen dead letters held at once before they are sent
SHOWN = 100  # dead letters a result lists


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
class RequeuedAcks:
    dead_letter_topic: str
    topic: str  # the ack topic they were sent to (each to the one it came from; comma-separated if several)
    requeued: int = 0  # messages sent (with dry_run: that would be)
    scanned: int = 0  # dead letters looked at
    not_scanned: int = 0  # older dead letters beyond the scan of each partition
    letters: list[DeadAck] = field(default_factory=list)  # the first SHOWN requeued, oldest first
    dry_run: bool = False


def text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    if isinstance(data, str):
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + data.hex()


def dead_ack(m: Message) -> DeadAck:
    """A dead-letter message as people read it."""
    headers: dict[str, bytes | str | None] = dict(m.headers() or [])
    src = text(headers.get("source-topic"))
    if headers.get("source-partition") is not None:
        src += f":{text(headers.get('source-partition'))}@{text(headers.get('source-offset'))}"
    kind, ms = m.timestamp()
    at = dt.datetime.fromtimestamp(ms / 1000, dt.UTC) if kind and ms > 0 else None
    return DeadAck(
        m.partition() or 0,
        m.offset() or 0,
        at,
        text(m.key()),
        text(m.value()),
        text(headers.get(REASON_HEADER)),
        text(headers.get(FAILURE_REASON_HEADER)) or None,
        src,
    )


def consumer(cfg: Config, name: str) -> Consumer:
    """A consumer that joins no group and commits nothing: partitions are assigned."""
    return Consumer(
        {
            "bootstrap.servers": cfg.kafka.bootstrap_servers,
            **cfg.kafka.client,
            "group.id": f"reaper-{name}-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "logger": logs.KafkaLogger(name),
        }
    )


def _size(m: Message) -> int:
    """The bytes a dead letter holds: its key, its value and its headers (a reason, a producer's
    failure reason: as large as the sender made them)."""
    pairs: list[Any] = list(m.headers() or [])  # a consumed message's: (name, bytes or None) pairs
    return len(m.key() or b"") + len(m.value() or b"") + sum(len(k) + len(v or b"") for k, v in pairs)


def _read(
    c: Consumer,
    wanted: list[TopicPartition],
    ends: dict[int, int],
    timeout: float,
    keep: Callable[[Message], bool] = lambda _m: True,
) -> tuple[list[Message], int]:
    """The messages of `wanted` (each from its offset) up to `ends` (exclusive) that `keep` accepts,
    and how many were read. Refuses (nothing sent yet) once those kept hold more than HELD_BYTES_MAX
    of keys, values and headers: what a partition holds is bounded by count, not by size."""
    c.assign(wanted)
    open_parts = {tp.partition for tp in wanted}
    out: list[Message] = []
    read = held = 0
    while open_parts:
        msgs = c.consume(500, timeout)
        if not msgs:
            raise AdminError(
                "Kafka went quiet while the dead letters were read: nothing was sent", ExitCode.UNAVAILABLE
            )
        for m in msgs:
            err, p = m.error(), m.partition() or 0
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    open_parts.discard(p)
                continue
            if p in open_parts and (m.offset() or 0) < ends[p]:
                read += 1
                if keep(m):
                    held += _size(m)
                    if held > HELD_BYTES_MAX:
                        raise AdminError(
                            f"the dead letters chosen hold more than {HELD_BYTES_MAX // 2**20} MiB: nothing was sent "
                            "(choose fewer with --reason or --at)",
                            ExitCode.REFUSED,
                        )
                    out.append(m)
            if (m.offset() or 0) + 1 >= ends[p]:
                open_parts.discard(p)
    return out, read


def select(
    cfg: Config, *, at: tuple[int, int] | None = None, reason: str | None = None, scan: int = SCAN
) -> tuple[list[Message], int, int]:
    """The dead letters chosen (the one at `at`; else those whose reason contains `reason`, or all,
    among the newest `scan` of each partition), how many were looked at, and how many older were not."""
    topic, timeout = cfg.acker.dead_letter_topic, cfg.console.kafka_timeout

    def matches(m: Message) -> bool:
        return reason is None or reason in text(dict(m.headers() or []).get(REASON_HEADER))

    c = consumer(cfg, "acks-requeue")
    try:
        meta = c.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta is None or meta.error is not None:
            if at is not None:
                missing = meta is None or meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
                why = "does not exist" if missing else f"cannot be read: {meta.error.str()}"
                raise AdminError(
                    f"no dead-lettered ack at {at[0]}:{at[1]}: the dead-letter topic {topic} "
                    f"(acker.dead_letter_topic) {why}",
                    ExitCode.NOT_FOUND,
                )
            return [], 0, 0
        marks = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout) for p in sorted(meta.partitions)}
        if at is not None:
            p, offset = at
            low, high = marks.get(p, (0, 0))
            if not low <= offset < high:
                raise AdminError(
                    f"no dead-lettered ack at {p}:{offset} in {topic} (gone, or never there)", ExitCode.NOT_FOUND
                )
            found, _ = _read(c, [TopicPartition(topic, p, offset)], {p: offset + 1}, timeout)
            if not [m for m in found if m.offset() == offset]:
                raise AdminError(f"no dead-lettered ack at {p}:{offset} in {topic}", ExitCode.NOT_FOUND)
            return found, len(found), 0
        wanted = [TopicPartition(topic, p, max(low, high - scan)) for p, (low, high) in marks.items() if high > low]
        skipped = sum(max(0, high - scan - low) for low, high in marks.values())
        ends = {p: high for p, (_, high) in marks.items()}
        chosen, scanned = _read(c, wanted, ends, timeout, matches) if wanted else ([], 0)
    except KafkaException as exc:
        raise AdminError(f"Kafka: {exc}", ExitCode.UNAVAILABLE) from None
    finally:
        c.close()
    return chosen, scanned, skipped


def destination(cfg: Config, m: Message) -> str:
    """The ack topic a dead letter goes back to: the one it came from (its source-topic header), or
    acker.topic for a letter set aside before that header existed."""
    return text(dict(m.headers() or []).get("source-topic")) or cfg.acker.topic


def requeue(
    cfg: Config,
    conn: psycopg.Connection,
    *,
    at: tuple[int, int] | None = None,
    reason: str | None = None,
    scan: int = SCAN,
    dry_run: bool = False,
) -> RequeuedAcks:
    """Send the chosen dead letters (see select) to the ack topic as they were sent first, with a
    requeued-from header; wait for Kafka to have them all, then record the requeue in admin_log.
    `conn` is idle while Kafka is read and written: check, send and record may run on different
    connections (the console holds none while it waits for Kafka)."""
    check(cfg, conn)
    sent = send(cfg, at=at, reason=reason, scan=scan, dry_run=dry_run)
    record(cfg, conn, sent)
    return sent.result


@dataclass
class Sent:
    """What send sent (or, with dry_run, would send), for record to write in admin_log."""

    result: RequeuedAcks
    where: list[str]  # partition:offset of each dead letter sent
    filter: dict[str, Any]


def check(cfg: Config, conn: psycopg.Connection) -> None:
    """The admin log is there to record the requeue (before anything is sent). Leaves conn idle."""
    require_tables(conn, cfg.database.schema, "admin_log")
    conn.rollback()


def send(
    cfg: Config,
    *,
    at: tuple[int, int] | None = None,
    reason: str | None = None,
    scan: int = SCAN,
    dry_run: bool = False,
) -> Sent:
    """Kafka's part of requeue: choose, send, wait until Kafka has them all (up to 30 s)."""
    a = cfg.acker
    chosen, scanned, skipped = select(cfg, at=at, reason=reason, scan=scan)
    # A letter cut down to fit the dead-letter topic is no longer the ack it was: never sent back.
    cut_down = [m for m in chosen if TRUNCATED_HEADER in dict(m.headers() or [])]
    if cut_down and at is not None:
        raise AdminError(
            f"the dead-lettered ack at {at[0]}:{at[1]} was cut down to fit the dead-letter topic "
            f"({text(dict(cut_down[0].headers() or []).get(TRUNCATED_HEADER))} cut): it is not the ack it was, "
            "so it cannot be sent again",
            ExitCode.REFUSED,
        )
    chosen = [m for m in chosen if TRUNCATED_HEADER not in dict(m.headers() or [])]
    chosen.sort(key=lambda m: (m.partition() or 0, m.offset() or 0))
    # Every schema's acker sets aside on the one dead-letter topic and batch ids are per schema: a
    # dead letter goes back to the ack topic it came from (its source-topic header), never another.
    known = set(ack_topics(cfg).values())
    targets = [destination(cfg, m) for m in chosen]
    strange = sorted({t for t in targets if t not in known})
    if strange:
        raise AdminError(
            f"dead letters from {', '.join(map(repr, strange[:3]))}, not an ack topic of this configuration: "
            "nothing was sent (requeue them with the configuration of the schema that acks on it)",
            ExitCode.REFUSED,
        )
    out = RequeuedAcks(
        a.dead_letter_topic, ", ".join(sorted(set(targets))) or a.topic, len(chosen), scanned, skipped, dry_run=dry_run
    )
    out.letters = [dead_ack(m) for m in chosen[:SHOWN]]
    filt = {"at": f"{at[0]}:{at[1]}"} if at is not None else {"reason": reason} if reason is not None else {"all": True}
    sent = Sent(out, [], filt)
    if dry_run or not chosen:
        return sent
    producer = Producer(
        {
            "bootstrap.servers": cfg.kafka.bootstrap_servers,
            **cfg.kafka.client,
            "enable.idempotence": True,
            "logger": logs.KafkaLogger("acks-requeue"),
        }
    )

    def requeued() -> Iterator[Record]:
        for m, target in zip(chosen, targets, strict=True):
            kept: list[Any] = list(m.headers() or [])
            headers: Headers = [(h[0], h[1]) for h in kept if h[0] == FAILURE_REASON_HEADER]
            headers.append((REQUEUED_FROM_HEADER, f"{a.dead_letter_topic}:{m.partition()}@{m.offset()}".encode()))
            yield target, m.key(), m.value(), headers

    left, failures = produce_all(producer, requeued())
    if left or failures:
        raise AdminError(
            f"not all were sent to {out.topic}: {left} still queued, failures {failures[:3]}; "
            "those that were are acks again (sending them twice is harmless)",
            ExitCode.UNAVAILABLE,
        )
    sent.where = [f"{m.partition()}:{m.offset()}" for m in chosen]
    return sent


def record(cfg: Config, conn: psycopg.Connection, sent: Sent) -> None:
    """Record a requeue that sent something in admin_log (nothing for a dry run or none sent)."""
    if not sent.where:
        return
    conn.execute(
        sql.SQL("INSERT INTO {} (action, rows, detail) VALUES ('acks-requeue', %s, %s::jsonb)").format(
            qualified(cfg.database.schema, "admin_log")
        ),
        [len(sent.where), json.dumps({"from": sent.where[:1000], "topic": sent.result.topic, "filter": sent.filter})],
    )
    conn.commit()


def render(r: RequeuedAcks) -> str:
    verb = "would send" if r.dry_run else "sent"
    n = f"{r.requeued} dead-lettered ack{'' if r.requeued == 1 else 's'}"
    lines = [f"{verb} {n} from {r.dead_letter_topic} to {r.topic} ({r.scanned} looked at)"]
    if r.not_scanned:
        lines.append(f"  {r.not_scanned} older dead letters were not looked at (raise --scan)")
    for d in r.letters:
        lines.append(f"  {d.partition}:{d.offset}  {d.entry}  ({d.reason})")
    if r.requeued > len(r.letters):
        lines.append(f"  ... and {r.requeued - len(r.letters)} more")
    return "\n".join(lines)
