"""The acker's dead letters (step 4 of its loop, harvester.services.acker): ack entries it could
not fold (malformed, too large) or the database rejected (unknown batch or group, index out of
range, batch expired), produced to the dead-letter topic before the acker commits its offsets.
A malformed entry is a letter of its own, unless its message has more than BAD_ENTRIES_MAX of them
(the message is then one letter, whole); the entries the database rejects are one letter per
group and reason. So the letters of a poll grow with its messages and groups, never faster than
the bytes it read.

Each letter is a message that could be sent to the ack topic again (a failure keeps its '!' and
its failure-reason header), with the reason it was set aside in the `reason` header and the topic
it came from in `source-topic` (every schema's acker shares the dead-letter topic; `reaper acks
requeue` reads both, harvester.admin.acks).

A letter Kafka refuses as too large (the ack message was near the size limit, or the dead-letter
topic's `max.message.bytes` is smaller than the ack topic's) is sent again cut down: its value,
and its key and header values if long, to `CUT_BYTES`, with a `truncated` header naming what was
cut and `original-size` the value's size; its reason and source headers stay whole. A letter
Kafka refuses even so, or refuses for what it is (an invalid record), is dropped with an error
line: sending it again could never succeed, and retrying it would stall the acker for good.
Anything else (a timeout, a broker away, the topic missing or not writable) is the topic's
trouble, not the letter's: `deliver` raises and the acker retries the poll after a back-off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Producer

from harvester.kafka_delivery import Headers, produce_each
from tracker.folding import FAIL_MARK, FAILURE_REASON_HEADER, Folded

REASON_HEADER = "reason"
TRUNCATED_HEADER = "truncated"  # what a cut-down letter lost: "value", "key", "headers", comma-separated
ORIGINAL_SIZE_HEADER = "original-size"  # the value's size in bytes before it was cut
CUT_BYTES = 1024  # what a cut-down letter keeps of its value, its key and each header value

# Kafka refused the record for its size: sent again cut down.
_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE, KafkaError.INVALID_MSG_SIZE})
# Kafka refused the record for what it is: sending it again cannot succeed.
_REFUSED = _TOO_LARGE | {KafkaError.INVALID_RECORD}  # (INVALID_MSG is a corrupt transfer: retried)

Letter = tuple[bytes | None, bytes | None, Headers]  # key, value, headers


def letters_of(source_topic: str, folded: Folded, rejected: list[tuple[str, str, str | None]]) -> list[Letter]:
    """The letters for a fold's bad entries, then for the entries the database rejected (entry, why,
    failure reason or None for an ack): one per group and reason."""
    letters: list[Letter] = []
    source = source_topic.encode()
    for n, (key, entry, reason, partition, offset) in enumerate(folded.bad):
        headers: Headers = [
            (REASON_HEADER, reason.encode()),
            ("source-topic", source),
            ("source-partition", str(partition).encode()),
            ("source-offset", str(offset).encode()),
        ]
        failure = folded.bad_failure.get(n)
        if failure is not None:
            headers.append((FAILURE_REASON_HEADER, failure))
        letters.append((key, entry, headers))
    # The database rejects a group's ids as runs of its mask (a mask of every other index is 4,096
    # runs): one letter per group, reason and outcome, its runs joined as one ack message would be.
    by_group: dict[tuple[str, str, str | None], list[str]] = {}
    for entry_text, reason, failure_reason in rejected:
        head = entry_text.rpartition(":")[0]
        by_group.setdefault((head, reason, failure_reason), []).append(
            entry_text if failure_reason is None else FAIL_MARK + entry_text
        )
    for (head, reason, failure_reason), entries in by_group.items():
        headers = [(REASON_HEADER, reason.encode()), ("source-topic", source)]
        if failure_reason is not None:
            headers.append((FAILURE_REASON_HEADER, failure_reason.encode()))
        letters.append((head.split(":", 1)[0].encode(), ",".join(entries).encode(), headers))
    return letters


@dataclass
class Delivery:
    """What `deliver` did: letters Kafka has (`truncated` of them cut down), and those dropped."""

    sent: int = 0
    truncated: int = 0
    dropped: list[str] = field(default_factory=list)  # why Kafka refused each dropped letter


def deliver(producer: Producer, topic: str, letters: list[Letter], timeout: float = 30.0) -> Delivery:
    """Produce the letters to `topic` and wait until Kafka has every one it can take: one refused
    as too large goes again cut down, one refused for good is dropped (see the module doc). Raise
    KafkaException if any was not delivered for another reason (the acker then retries the poll)."""
    out = Delivery()
    errors = _send(producer, topic, letters, timeout)
    for n in [n for n, err in errors.items() if err.code() in _TOO_LARGE]:
        # The broker refuses a whole request batch that is over the topic's limit, small letters
        # in it too: each is sent again alone as it is, and only one refused alone is cut down.
        alone = _send(producer, topic, [letters[n]], timeout).get(0)
        if alone is not None and alone.code() in _TOO_LARGE:
            shortened = cut(letters[n])
            alone = _send(producer, topic, [shortened], timeout).get(0) if shortened is not None else alone
            out.truncated += alone is None
        if alone is None:
            del errors[n]
        else:
            errors[n] = alone
    out.dropped = [str(err) for err in errors.values() if err.code() in _REFUSED]
    out.sent = len(letters) - len(errors)
    _raise_temporary(errors)
    return out


def cut(letter: Letter) -> Letter | None:
    """The letter cut down to what any topic takes: value, key and long header values to CUT_BYTES,
    with headers saying what was cut and the value's original size; None when nothing is that long."""
    key, value, headers = letter
    lost = []
    if value is not None and len(value) > CUT_BYTES:
        lost.append("value")
    if key is not None and len(key) > CUT_BYTES:
        key = key[:CUT_BYTES]
        lost.append("key")
    kept: Headers = []
    for name, raw in headers:
        if raw is not None and len(raw) > CUT_BYTES:
            raw = raw[:CUT_BYTES]
            if "headers" not in lost:
                lost.append("headers")
        kept.append((name, raw))
    if not lost:
        return None
    kept += [(TRUNCATED_HEADER, ",".join(lost).encode()), (ORIGINAL_SIZE_HEADER, str(len(value or b"")).encode())]
    return key, None if value is None else value[:CUT_BYTES], kept


def _send(producer: Producer, topic: str, letters: list[Letter], timeout: float) -> dict[int, KafkaError]:
    """The letters produced and flushed; the errors by letter index (harvester.kafka_delivery)."""
    return produce_each(producer, ((topic, key, value, headers) for key, value, headers in letters), timeout)


def _raise_temporary(errors: dict[int, KafkaError]) -> None:
    temporary = [err for err in errors.values() if err.code() not in _REFUSED]
    if temporary:
        raise KafkaException(
            KafkaError(
                temporary[0].code(),
                f"{len(temporary)} dead letter(s) not delivered: {[str(e) for e in temporary[:3]]}",
            )
        )
