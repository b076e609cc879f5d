"""A Kafka consumer that runs each record's effect through the inbox, and commits offsets only
after the database.

    from tracker.inbox.consumer import InboxConsumer

    def book(conn: psycopg.Connection, record: confluent_kafka.Message) -> None:
        conn.execute("INSERT INTO bookings ...", [...])   # the effect, in the inbox's transaction

    with psycopg.connect(dsn) as conn:
        c = InboxConsumer({"bootstrap.servers": ..., "group.id": "billing"}, ["orders"], conn,
                          Inbox("billing"), book, dead_letter_topic="orders-dead")
        c.run(stop)                                    # a threading.Event

Each poll returns up to `batch` records (100). They are processed in ONE database transaction, each
in a savepoint of it (`Inbox.run_once`: a record whose message id the inbox holds runs nothing), then
the transaction commits, and only then are the records' offsets committed to Kafka (synchronously,
manual commits only). A crash between the database commit and the offset commit redelivers the
records, and the inbox runs none of them again.

A record's message id is its `message-id` header (ASCII, 1 to 200 characters). A record without
one, or whose handler raises, goes to `dead_letter_topic` when one is given (the record as it was,
plus a `dead-letter-reason` header, sent once the database has committed), its effect rolled back
alone; without a dead-letter topic the
helper rolls the whole transaction back, commits no offset and raises (the records come again).
What is no fault of the record is never dead-lettered: an error of the inbox itself (no partition
covers now: its maintenance has not run) or one a retry can mend, whoever met it (a serialization
failure, a deadlock, a lock or statement timeout, a lost connection), rolls the poll back and raises.
A handler that meets such an error on the same record PASSING_TRIES (5) polls in a row has its
record dead-lettered: a timeout only that record's work reaches would otherwise stop the consumer.
The helper owns `conn`'s transactions: it commits and rolls back; hand it a connection of its own.
A poll that raises leaves the consumer at its first records again, so polling on gets them again.
A handler that commits or rolls back itself stops the poll with `HandlerEndedTransaction` (nothing
acknowledged); a dead letter the broker refuses, with `DeadLetterError` (the records come again).
Each claim holds a transaction advisory lock until the commit (sql/R__inbox.sql says why): a
`batch` of thousands per consumer needs Postgres' max_locks_per_transaction raised.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from tracker import message_ids
from tracker.drivers.connections import SyncSession
from tracker.errors import InvalidValue, TrackerError
from tracker.inbox.core import check_text
from tracker.inbox.sync import Inbox
from tracker.kafka_waits import with_waits
from tracker.message_ids import MESSAGE_ID_HEADER

DEAD_LETTER_REASON_HEADER = "dead-letter-reason"
_REASON_MAX = 500

Handler = Callable[[psycopg.Connection, Message], object]


class MissingMessageId(TrackerError, LookupError):
    """A Kafka record without the `message-id` header (not published by the reaper, or by one
    that predates message ids)."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(f"record {where} has no {MESSAGE_ID_HEADER!r} header")


class DeadLetterError(TrackerError, KafkaException):
    """A dead letter was not delivered to its topic (the broker refused it, or it timed out): the
    poll's offsets are not committed, so its records come again."""

    def __init__(self, topic: str, why: str) -> None:
        self.topic = topic
        super().__init__(f"dead letter not delivered to {topic!r}: {why}")


class HandlerEndedTransaction(TrackerError):
    """A handler committed or rolled back the helper's transaction itself (the helper owns it): the
    poll is rolled back and no offset is committed, so its records come again."""

    def __init__(self, where: str) -> None:
        self.where = where
        super().__init__(
            f"the handler of record {where} ended the consumer's transaction (commit or rollback);"
            " the helper commits once per poll: a handler must not"
        )


def _where(record: Any) -> str:
    try:
        return f"{record.topic()}[{record.partition()}]@{record.offset()}"
    except Exception:  # not a confluent_kafka Message: name its type
        return type(record).__name__


def message_id_of(record: Any) -> str:
    """The message id of a record (a confluent_kafka Message, or anything with `.headers()` as a
    list of (name, bytes)): the reaper's `message-id` header, the last one (a row's own headers come
    first, so a producer cannot pass its own id off as the reaper's). Raises MissingMessageId, or
    InvalidValue naming the header's value as written."""
    found = message_ids.message_id_of(record)
    if found is None:
        raise MissingMessageId(_where(record))
    return check_text(MESSAGE_ID_HEADER, found)


@dataclass
class PollResult:
    records: int = 0
    processed: int = 0  # effects run
    duplicates: int = 0  # records the inbox had seen: nothing ran
    dead_lettered: int = 0


class _Watched:
    """A record's handler, remembering whether it raised: an error of the inbox itself (no
    partition covers now, a lost connection) is no fault of the record and must not divert it."""

    def __init__(self, effect: Callable[[psycopg.Connection], object]) -> None:
        self.effect, self.raised = effect, False

    def __call__(self, session: SyncSession) -> object:
        try:
            return self.effect(cast(psycopg.Connection, session))  # InboxConsumer's own connection
        except BaseException:
            self.raised = True
            raise


# What a retry can mend, whoever met it (SQLSTATEs): the transaction was chosen to give way (a
# serialization failure, a deadlock), a lock or a statement timed out, the server is going away or
# full; and class 08 (or none: the client's own), the connection lost. Not the rest of class 53-57
# (a program limit, say): those meet the same record the same way every time.
_PASSING_STATES = frozenset({"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03", "53300"})
# A handler meeting a passing error this many polls in a row on the same record gives up on it: the
# record is dead-lettered (a statement timeout, say, that only this record's work reaches).
PASSING_TRIES = 5


def _passing(exc: BaseException) -> bool:
    for e in (exc, exc.__cause__):
        if isinstance(e, psycopg.Error) and (
            e.sqlstate in _PASSING_STATES
            or (e.sqlstate or "").startswith("08")
            or (e.sqlstate is None and isinstance(e, psycopg.OperationalError))
        ):
            return True
    return False


def _records_fault(exc: BaseException, handler_raised: bool) -> bool:
    """Whether `exc` says the record itself cannot be processed (dead-letter it): it has no usable
    message id, or its handler raised for a reason a retry would meet again."""
    if isinstance(exc, MissingMessageId) or (isinstance(exc, InvalidValue) and not handler_raised):
        return True  # message_id_of's, or the claim's refusal of the id (the only input it checks)
    return handler_raised and not _passing(exc)


def _partition_end(record: Message) -> bool:
    err = record.error()
    return err is not None and err.code() == KafkaError._PARTITION_EOF


class InboxConsumer:
    """Consumes `topics` in the consumer group of `config` ("group.id"), running `handler(conn,
    record)` once per message id through `inbox`. `config` is librdkafka's; the helper sets
    enable.auto.commit and enable.auto.offset.store to false itself and refuses a config that sets
    them. Its settings override the helper's defaults, which give a broker that answers nothing up
    after 15 s (tracker.kafka_waits). Not thread-safe: one thread polls."""

    def __init__(
        self,
        config: dict[str, Any],
        topics: Sequence[str],
        conn: psycopg.Connection,
        inbox: Inbox,
        handler: Handler,
        *,
        dead_letter_topic: str | None = None,
        batch: int = 100,
        poll_timeout: float = 0.5,
    ) -> None:
        for k in ("enable.auto.commit", "enable.auto.offset.store"):
            if str(config.get(k, "false")).lower() != "false":
                raise InvalidValue(k, config[k], "the inbox consumer commits offsets itself, after the database")
        if not 1 <= batch <= 100_000:
            raise InvalidValue("batch", batch, "must be between 1 and 100000")
        if not isinstance(conn, psycopg.Connection) or conn.autocommit:
            raise InvalidValue("conn", conn, "must be a psycopg Connection that is not in autocommit mode")
        self.conn, self.inbox, self.handler = conn, inbox, handler
        self.batch, self.poll_timeout = batch, poll_timeout
        # a silent broker is given up after 15 s, not librdkafka's 30-60 s (tracker.kafka_waits)
        self.consumer = Consumer(
            {**with_waits(config, producer=False), "enable.auto.commit": False, "enable.auto.offset.store": False}
        )
        self.consumer.subscribe(list(topics))
        self.dead_letter_topic = dead_letter_topic
        self._dead: Producer | None = None
        if dead_letter_topic:
            keep = {k: v for k, v in config.items() if not k.startswith(("group.", "enable.auto", "auto.offset"))}
            self._dead = Producer({**with_waits(keep, producer=True), "enable.idempotence": True})
        self._undelivered: list[str] = []  # delivery errors of this poll's dead letters
        self._passing_tries: dict[tuple, int] = {}  # (topic, partition, offset) -> polls a handler met a passing error
        self.totals = PollResult()

    def _tried_too_often(self, record: Message, exc: BaseException, handler_raised: bool) -> bool:
        """A handler's passing error on `record`, counted: True (dead-letter it) at the
        PASSING_TRIES-th poll in a row that met one there. The inbox's own errors are never the
        record's: its records wait (no partition covers now, say) however long it lasts."""
        if not handler_raised or not _passing(exc):
            return False
        where = (record.topic(), record.partition(), record.offset())
        if len(self._passing_tries) > 10_000:  # records left behind (revoked partitions): forgotten
            self._passing_tries.clear()
        tries = self._passing_tries.get(where, 0) + 1
        if tries >= PASSING_TRIES:
            self._passing_tries.pop(where, None)
            return True
        self._passing_tries[where] = tries
        return False

    def _effect(self, record: Message, conn: psycopg.Connection) -> object:
        return self.handler(conn, record)

    def _dead_letter(self, record: Message, why: BaseException) -> None:
        assert self._dead is not None and self.dead_letter_topic
        reason = f"{type(why).__name__}: {why}"[:_REASON_MAX].encode("utf-8", "replace")
        headers: list[tuple[str, str | bytes | None]] = [(str(h[0]), h[1]) for h in record.headers() or []]
        headers.append((DEAD_LETTER_REASON_HEADER, reason))
        self._dead.produce(
            self.dead_letter_topic, value=record.value(), key=record.key(), headers=headers, on_delivery=self._delivered
        )

    def _delivered(self, err: Any, msg: Message) -> None:
        # flush() counts only records still queued: one the broker refused has left the queue, and
        # only this callback tells.
        if err is not None:
            self._undelivered.append(str(err))

    def _ended(self, started: object) -> bool:
        """Whether the poll's transaction (begun at `started`) is gone: a handler committed or
        rolled it back itself. Then the call's savepoint was gone too, so its undo could not
        restore the transaction (not INTRANS), or a later statement began another one."""
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
            return True
        row = self.conn.execute("SELECT transaction_timestamp()").fetchone()
        return row is None or row[0] != started

    def process(self, records: Sequence[Message]) -> tuple[PollResult, list[TopicPartition]]:
        """Run the records through the inbox in one transaction and commit it; return what
        happened and the offsets to commit (not committed here)."""
        got = PollResult(records=len(records))
        offsets: dict[tuple[str, int], int] = {}
        dead: list[tuple[Message, BaseException]] = []
        self._undelivered.clear()
        try:
            # The poll's transaction begins here; its start time tells it from any other.
            row = self.conn.execute("SELECT transaction_timestamp()").fetchone()
            started = row[0] if row else None
            for record in records:
                if record.error() is not None:
                    raise KafkaException(record.error())
                topic, partition, offset = record.topic(), record.partition(), record.offset()
                assert topic is not None and partition is not None and offset is not None  # a consumed record
                offsets[(topic, partition)] = offset + 1
                handler = _Watched(functools.partial(self._effect, record))
                try:
                    mid = message_id_of(record)
                    done = self.inbox.run_once(self.conn, mid, handler)
                except Exception as exc:  # the record's savepoint is undone: the rest goes on
                    if self._ended(started):  # undone with the records before it: none may be acked
                        raise HandlerEndedTransaction(_where(record)) from exc
                    if self._dead is None or not (
                        _records_fault(exc, handler.raised) or self._tried_too_often(record, exc, handler.raised)
                    ):
                        raise  # the poll is rolled back and comes again
                    dead.append((record, exc))  # produced once the database has committed (below)
                    got.dead_lettered += 1
                    continue
                got.processed += done.first_time
                got.duplicates += not done.first_time
            self.conn.commit()
        except BaseException:
            if not self.conn.closed:
                self.conn.rollback()
            raise
        if self._dead is not None and dead:
            # Only now: a poll whose commit failed comes again whole, and its records' dead letters
            # would have gone out twice (or for a record that then succeeds). They must be in Kafka
            # before the offsets move on: else the records come again.
            assert self.dead_letter_topic
            for record, why in dead:
                self._dead_letter(record, why)
            if self._dead.flush(30) > 0:
                raise DeadLetterError(self.dead_letter_topic, "not delivered within 30 s")
            if self._undelivered:
                raise DeadLetterError(self.dead_letter_topic, self._undelivered[0])
        return got, [TopicPartition(t, p, o) for (t, p), o in offsets.items()]

    def poll_once(self) -> PollResult:
        """One poll: process the records, commit the database, then the offsets."""
        # An end-of-partition event (enable.partition.eof) says there is nothing more for now: not a
        # record, and not an error to stop the consumer for.
        records = [r for r in self.consumer.consume(self.batch, self.poll_timeout) if not _partition_end(r)]
        if not records:
            return PollResult()
        try:
            got, offsets = self.process(records)
        except BaseException:
            self._rewind(records)
            raise
        self.consumer.commit(offsets=offsets, asynchronous=False)
        for name in ("records", "processed", "duplicates", "dead_lettered"):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(got, name))
        return got

    def _rewind(self, records: Sequence[Message]) -> None:
        """Move the consumer back to the first record of each partition of a poll that failed: its
        position is past them, and the next poll's offset commit would acknowledge them unseen."""
        first: dict[tuple[str, int], int] = {}
        for record in records:
            topic, partition, offset = record.topic(), record.partition(), record.offset()
            if record.error() is None and topic is not None and partition is not None and offset is not None:
                first.setdefault((topic, partition), offset)
        for (topic, partition), offset in first.items():
            try:
                self.consumer.seek(TopicPartition(topic, partition, offset))
            except KafkaException:
                pass  # no longer assigned: its next owner starts from the committed offset

    def run(self, stop: threading.Event) -> None:
        """Poll until `stop` is set; then close the consumer (leaving the group)."""
        try:
            while not stop.is_set():
                self.poll_once()
        finally:
            self.close()

    def close(self) -> None:
        self.consumer.close()
        if self._dead is not None:
            self._dead.flush(30)


__all__ = [
    "DEAD_LETTER_REASON_HEADER",
    "DeadLetterError",
    "HandlerEndedTransaction",
    "MESSAGE_ID_HEADER",
    "InboxConsumer",
    "MissingMessageId",
    "PollResult",
    "message_id_of",
]
