"""Helpers for consumers of fanned-out messages: which item a message is, and three ways to ack it.

- `item_id_of(message)`: the item id a Kafka message carries in its `item-id` header.
- `AckProducer`: acks (and failures) to the ack topic for the reaper's acker, keyed by batch id;
  contiguous indexes of a group are compacted into the run form and one batch's acks share messages.
- `exactly_once(session, item_id, effect)`: the ack and the consumer's own database side effect
  in one transaction; the effect runs only if this item's bit was still set.
  (The direct path is `tracker.ack(session, ids)`.)

Ack message format (what the acker reads): the value is one or more entries separated by ',', each an
item id `<batch>:<group>:<index>` or a run `<batch>:<group>:<start>-<end>` (end inclusive): an
ack; or the same written after a '!': a failure, under the reason the message carries in its
`failure-reason` header (UTF-8, 1 to 500 characters, as `tracker.fail` takes). The key is the
batch id in decimal, so one batch's acks and failures meet in one partition, in order.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from confluent_kafka import KafkaError, KafkaException, Producer

from tracker.core.acks import Processed as Processed
from tracker.core.validate import check_reason, check_topic, id_list
from tracker.errors import InvalidArgument, InvalidValue, MalformedItemId, TrackerError
from tracker.folding.entries import MASK_BYTES_MAX, OUT_OF_RANGE
from tracker.folding.messages import FAIL_MARK, FAILURE_REASON_HEADER
from tracker.ids import GROUP_BITS_MAX, GROUPS_PER_FOLD_MAX, format_run, parse_ack, parse_item_id
from tracker.kafka_waits import with_waits
from tracker.sync import exactly_once as exactly_once

ITEM_ID_HEADER = "item-id"
BATCH_ID_HEADER = "batch-id"
ACK_SEPARATOR = ","

T = TypeVar("T")


class MissingItemId(TrackerError, LookupError):
    """A Kafka message without the `item-id` header every tracked outbox message carries."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(f"message {where} has no {ITEM_ID_HEADER!r} header: it was not written by outbox.enqueue")


def _where(message: Any) -> str:
    try:
        return f"{message.topic()}[{message.partition()}]@{message.offset()}"
    except Exception:  # not a confluent_kafka Message: name its type
        return type(message).__name__


def _header(message: Any, name: str) -> bytes | None:
    headers = message.headers() if callable(getattr(message, "headers", None)) else getattr(message, "headers", None)
    for key, value in headers or ():
        if key == name:
            return value
    return None


def item_id_of(message: Any) -> str:
    """The validated item id of a Kafka message (confluent_kafka Message, or anything with
    `.headers()` as a list of (name, bytes)). Raises MissingItemId or MalformedItemId."""
    raw = _header(message, ITEM_ID_HEADER)
    if raw is None:
        raise MissingItemId(_where(message))
    parse_item_id(raw)
    return raw.decode("ascii")


def batch_id_of_message(message: Any) -> int:
    """The batch id of a Kafka message, from its `batch-id` header (else its item id)."""
    raw = _header(message, BATCH_ID_HEADER)
    if raw is not None:
        try:  # read as an item id's batch part is: a plain decimal within a bigint, or malformed
            return parse_item_id(raw + b":0:0").batch_id
        except MalformedItemId:
            pass
    return parse_item_id(item_id_of(message)).batch_id


# ---------------------------------------------------------------- acks through Kafka


def runs_of(bits: bytes | bytearray) -> list[tuple[int, int]]:
    """The set bits of a mask (index i = bit 7 - i % 8 of byte i // 8) as inclusive runs."""
    runs: list[tuple[int, int]] = []
    start = None
    for byte_no, byte in enumerate(bits):
        if byte == 0 or byte == 0xFF:  # whole bytes: a run ends or goes on
            if byte == 0 and start is not None:
                runs.append((start, byte_no * 8 - 1))
                start = None
            elif byte and start is None:
                start = byte_no * 8
            continue
        for bit in range(8):
            if byte & (0x80 >> bit):
                if start is None:
                    start = byte_no * 8 + bit
            elif start is not None:
                runs.append((start, byte_no * 8 + bit - 1))
                start = None
    if start is not None:
        runs.append((start, len(bits) * 8 - 1))
    return runs


def compact(indexes: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted, de-duplicated indexes as inclusive (start, end) runs."""
    runs: list[tuple[int, int]] = []
    start = prev = -2  # indexes are >= 0: -2 means "no run open"
    for i in sorted(set(indexes)):
        if prev >= 0 and i == prev + 1:
            prev = i
            continue
        if start >= 0:
            runs.append((start, prev))
        start = prev = i
    if start >= 0:
        runs.append((start, prev))
    return runs


def _entry_text(entry: object) -> str:
    text = entry.decode("ascii", "replace") if isinstance(entry, bytes) else entry
    if not isinstance(text, str):
        raise MalformedItemId(entry, "not a str")
    return text


def _fold_one(folder: Any, entry: object, fold: bool = True) -> bool:
    """folder.take(entry) (with fold=False, only the check of it), its refusal named as the
    caller wrote the entry."""
    from tracker.errors import IndexOutOfRange

    text = _entry_text(entry)
    try:
        if fold:
            return folder.take(text)
        parse_ack(text)
        return True
    except MalformedItemId as exc:
        raise MalformedItemId(entry, exc.reason) from None  # named as the caller wrote it (bytes, say)
    except IndexOutOfRange:
        raise MalformedItemId(entry, f"index beyond any group (max {GROUP_BITS_MAX - 1}): {OUT_OF_RANGE}") from None


def _fold_ids(item_ids: str | bytes | Iterable[str | bytes]) -> Iterator[dict[tuple[int, int], Any]]:
    """Item ids and runs folded with the acker's bounds-checked fold (no mask beyond 8192 bits),
    each mask only as long as its highest index, in rounds of at most MASK_BYTES_MAX bytes of masks
    (as tracker.fold bounds one fold). Every entry is checked before the first round is returned:
    MalformedItemId names the first bad one, and then nothing of the call may be buffered."""
    from tracker.folding import EntryFolder

    entries = id_list(item_ids)  # one id, or an iterable of them: not a dict, a number or None
    folder = EntryFolder(max_mask_bytes=MASK_BYTES_MAX)
    for i, entry in enumerate(entries):
        if not _fold_one(folder, entry):
            # Past one round's masks: check the rest (without folding it), then fold in rounds.
            for later in entries[i:]:
                _fold_one(None, later, fold=False)
            return _rounds(entries)
    return iter([folder.masks])


def _rounds(entries: list) -> Iterator[dict[tuple[int, int], Any]]:
    from tracker.folding import EntryFolder

    folder = EntryFolder(max_mask_bytes=MASK_BYTES_MAX)
    for entry in entries:
        if not _fold_one(folder, entry):
            yield folder.masks
            folder = EntryFolder(max_mask_bytes=MASK_BYTES_MAX)
            _fold_one(folder, entry)  # one entry's mask (at most 1 KiB) fits an empty round
    if folder.masks:
        yield folder.masks


CLIENT_MESSAGE_MAX = 1_000_000  # librdkafka's default message.max.bytes
MESSAGE_OVERHEAD = 4096  # key, a failure reason of 500 characters (up to 2,000 bytes), framing


def _int_setting(conf: dict, name: str, default: int) -> int:
    value = conf.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidValue(f"kafka_client[{name!r}]", value, "must be an integer") from None


class AckDeliveryError(TrackerError):
    """An AckProducer's flush() found ack or failure messages Kafka did not take (`failures`: why)."""

    def __init__(self, failures: list[str]) -> None:
        self.failures = failures
        super().__init__(f"{len(failures)} ack message(s) were not delivered: {failures[:3]}")


class AckProducer:
    """Buffers acks and failures and produces them to the ack topic, compacted into runs.

    `ack()` and `fail()` validate each id (and a failure's reason) and buffer it; the buffer is
    sent when it holds `max_pending` ids, when `linger` seconds have passed since the oldest
    buffered one (checked on every call), and by `flush()`, which also waits until Kafka has every
    message. An ack or failure is only safe once a `flush()` has returned: call it before
    committing your own consumer offsets. The first outcome given for an item wins, as with
    `tracker.ack` and `tracker.fail`: one still buffered makes a later other outcome of the item a
    duplicate (left out), and one already sent precedes it in the batch's partition. Thread-safe.

    `kafka_client`: librdkafka settings, which override the helper's own: idempotence, lz4, and
    a broker that answers nothing given up after 15 s (tracker.kafka_waits.PRODUCER_DEFAULTS).
    """

    def __init__(
        self,
        *,
        bootstrap_servers: str,
        topic: str,
        kafka_client: Mapping[str, Any] | None = None,
        max_pending: int = 100_000,
        linger: float = 0.05,
        max_message_bytes: int = 64 * 1024,
    ) -> None:
        check_topic(topic, "topic")
        if kafka_client is not None and not isinstance(kafka_client, Mapping):
            raise InvalidArgument("kafka_client", kafka_client, "a mapping of librdkafka settings, or None")
        client = dict(kafka_client or {})
        for name, given, low in (("max_pending", max_pending, 1), ("max_message_bytes", max_message_bytes, 64)):
            if not isinstance(given, int) or isinstance(given, bool):
                raise InvalidArgument(name, given, f"an int >= {low}")
            if given < low:
                raise InvalidValue(name, given, f"must be >= {low}")
        if not isinstance(linger, (int, float)) or isinstance(linger, bool):
            raise InvalidArgument("linger", linger, "a number of seconds >= 0")
        if not math.isfinite(linger) or linger < 0:
            raise InvalidValue("linger", linger, "must be a finite number of seconds >= 0")
        # A message of max_message_bytes, with its key, failure-reason header and record framing,
        # must be one the client itself takes: else every send of a full message is refused.
        client_limit = _int_setting(client, "message.max.bytes", CLIENT_MESSAGE_MAX)
        if max_message_bytes + MESSAGE_OVERHEAD > client_limit:
            raise InvalidValue(
                "max_message_bytes",
                max_message_bytes,
                f"must be at most the client's message.max.bytes ({client_limit}) less {MESSAGE_OVERHEAD} "
                "bytes for the key, headers and framing",
            )
        conf = {
            "bootstrap.servers": bootstrap_servers,
            "enable.idempotence": True,
            "linger.ms": 5,
            "compression.type": "lz4",
            # a silent broker is given up after 15 s, not librdkafka's 30-60 s (tracker.kafka_waits)
            **with_waits(client, producer=True),
        }
        self._producer = Producer(conf)
        self.topic = topic
        self.max_pending = max_pending
        self.linger = linger
        self.max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._pending: dict[tuple[int, int], bytearray] = {}  # (batch, group) -> mask of acked indexes
        # reason -> (batch, group) -> mask of failed indexes; disjoint from each other and from acks
        self._failing: dict[str, dict[tuple[int, int], bytearray]] = {}
        self._count = 0
        self._oldest: float | None = None
        self._failures: list[str] = []
        self.messages_sent = 0
        self.acks_sent = 0
        self.failures_sent = 0

    def ack(self, item_ids: str | bytes | Iterable[str | bytes]) -> None:
        """Buffer item ids or runs; raises MalformedItemId (buffering none of the call) on a bad one.
        Ids in many groups are buffered (and sent) in rounds, so what is held stays bounded. A send
        this call sets off that produce() refuses raises AckDeliveryError, the round kept buffered."""
        self._buffer_rounds(_fold_ids(item_ids), None)

    def fail(self, item_ids: str | bytes | Iterable[str | bytes], reason: str) -> None:
        """Buffer item ids or runs as failed under `reason` (1 to 500 characters, as `tracker.fail`
        takes it). Raises InvalidValue or InvalidArgument for the reason, MalformedItemId for an
        id; then none of the call is buffered."""
        checked = check_reason(reason)
        self._buffer_rounds(_fold_ids(item_ids), checked)

    def _buffer_rounds(self, rounds: Iterable[dict[tuple[int, int], Any]], reason: str | None) -> None:
        """Every round of one call buffered, even when a send between them is refused (that round
        stays buffered): a call's later rounds were left out, and a flush() then returned without them."""
        refused: AckDeliveryError | None = None
        for masks in rounds:
            try:
                self._buffer(masks, reason)
            except AckDeliveryError as exc:
                refused = refused or exc
        if refused is not None:
            raise refused

    def _buffer(self, masks: dict[tuple[int, int], Any], reason: str | None) -> None:
        with self._lock:
            into = self._pending if reason is None else self._failing.setdefault(reason, {})
            others = [m for r, m in self._failing.items() if r != reason]
            if reason is not None:
                others.append(self._pending)
            for key, mask in masks.items():
                bits = mask.bits
                if others:  # the first outcome of an item wins: leave out ids another outcome holds
                    # Masks are as long as their highest index (byte i holds indexes 8i..8i+7): align
                    # them on the longest before comparing, then cut back to this one's length.
                    helds = [other[key] for other in others if key in other]
                    if helds:
                        width = max(len(bits), *map(len, helds))
                        taken = 0
                        for other_bits in helds:
                            taken |= int.from_bytes(other_bits, "big") << (8 * (width - len(other_bits)))
                        mine = (int.from_bytes(bits, "big") << (8 * (width - len(bits)))) & ~taken
                        if not mine:
                            continue
                        bits = bytearray((mine >> (8 * (width - len(bits)))).to_bytes(len(bits), "big"))
                held = into.get(key)
                if held is None:
                    into[key] = bits
                else:
                    width = max(len(held), len(bits))
                    merged = (int.from_bytes(held, "big") << (8 * (width - len(held)))) | (
                        int.from_bytes(bits, "big") << (8 * (width - len(bits)))
                    )
                    into[key] = bytearray(merged.to_bytes(width, "big"))
                self._count += mask.count
            if reason is not None and not into:
                del self._failing[reason]
            if self._oldest is None and masks:
                self._oldest = time.monotonic()
            # Sent at max_pending ids, after linger, or once the groups held could take more than
            # one fold's masks (MASK_BYTES_MAX): the buffer's memory is bounded whatever the ids name.
            groups = len(self._pending) + sum(map(len, self._failing.values()))
            due = (
                self._count >= self.max_pending
                or groups >= GROUPS_PER_FOLD_MAX
                or (self._oldest is not None and time.monotonic() - self._oldest >= self.linger)
            )
            if due:
                self._send_locked()
        self._producer.poll(0)

    def _send_locked(self) -> None:
        pending, count, oldest = self._pending, self._count, self._oldest
        failing = self._failing
        self._pending, self._failing, self._count, self._oldest = {}, {}, 0, None
        try:
            self._send_masks(pending, None)
            for reason, masks in failing.items():
                self._send_masks(masks, reason)
        except KafkaException as exc:
            # produce() refused a message (a fatal producer error, say): the round is buffered
            # again whole, what was produced of it too (acks and failures are idempotent: a
            # duplicate at most), so no flush() returns while any of it is missing.
            self._pending, self._failing, self._count, self._oldest = pending, failing, count, oldest
            raise AckDeliveryError([f"produce() refused an ack message: {exc}"]) from exc

    def _send_masks(self, pending: dict[tuple[int, int], bytearray], reason: str | None) -> None:
        by_batch: dict[int, list[tuple[int, bytearray]]] = {}
        for (batch_id, group_id), bits in pending.items():
            by_batch.setdefault(batch_id, []).append((group_id, bits))
        mark = "" if reason is None else FAIL_MARK
        headers: list[tuple[str, str | bytes | None]] | None = (
            None if reason is None else [(FAILURE_REASON_HEADER, reason.encode())]
        )
        for batch_id, groups in by_batch.items():
            key = str(batch_id).encode()
            parts: list[str] = []
            size = 0
            acks = 0
            named = 0  # groups in the message: the acker sets aside one naming more than it folds at once
            for group_id, bits in sorted(groups, key=lambda g: g[0]):
                if named == GROUPS_PER_FOLD_MAX:
                    self._produce(key, parts, acks, headers)
                    parts, size, acks, named = [], 0, 0, 0
                named += 1
                for start, end in runs_of(bits):
                    entry = mark + format_run(batch_id, group_id, start, end)
                    if parts and size + len(entry) + 1 > self.max_message_bytes:
                        self._produce(key, parts, acks, headers)
                        parts, size, acks, named = [], 0, 0, 1
                    parts.append(entry)
                    size += len(entry) + 1
                    acks += end - start + 1
            if parts:
                self._produce(key, parts, acks, headers)

    def _produce(
        self, key: bytes, parts: list[str], acks: int, headers: list[tuple[str, str | bytes | None]] | None
    ) -> None:
        value = ACK_SEPARATOR.join(parts).encode()
        while True:
            try:
                if headers is None:
                    self._producer.produce(self.topic, key=key, value=value, on_delivery=self._delivered)
                else:
                    self._producer.produce(
                        self.topic, key=key, value=value, headers=headers, on_delivery=self._delivered
                    )
                break
            except BufferError:  # local queue full: let deliveries drain, then retry
                self._producer.poll(0.1)
        self.messages_sent += 1
        if headers is None:
            self.acks_sent += acks
        else:
            self.failures_sent += acks

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        if err is not None:
            self._failures.append(f"{msg.value()[:80]!r}: {err}")

    def flush(self, timeout: float = 60.0) -> None:
        """Send everything buffered and wait until Kafka has it; raises AckDeliveryError otherwise
        (then do not commit your consumer offsets: what produce() refused is still buffered and
        goes with the next send, but a message Kafka refused after taking it is gone, and its
        records must come again)."""
        with self._lock:
            self._send_locked()
        left = self._producer.flush(timeout)
        failures, self._failures = self._failures, []
        if left:
            failures.append(f"{left} message(s) still queued after {timeout}s")
        if failures:
            raise AckDeliveryError(failures)

    def close(self, timeout: float = 60.0) -> None:
        self.flush(timeout)

    def __enter__(self) -> AckProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
