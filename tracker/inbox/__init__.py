"""The inbox: exactly-once effects for consumers of any message.

A consumer records each message id it processes in its own transaction, with its effect; a
redelivery, a concurrent duplicate on another consumer instance, or a retry after a crash before
the commit finds the id and runs nothing:

    from tracker import inbox

    with psycopg.connect(dsn) as conn:                 # or a SQLAlchemy Session
        done = inbox.run_once(conn, message_id, lambda c: book(c, order), consumer="billing")
        conn.commit()                                  # the effect and the id commit together
        if not done.first_time: ...                    # a duplicate: nothing ran

`consumer` names the consumer (a service or consumer group): two consumers of one message each
process it once. Every call runs in a savepoint of the caller's transaction and never commits it, in
every connection mode the tracker takes (tracker.sync, tracker.aio; PgBouncer in transaction mode
included). The asyncio face is `tracker.inbox.aio`; other languages call the SQL function
`inbox_claim(consumer, message_id)` (sql/R__inbox.sql). Ids are kept for a retention window in
time partitions that the maintenance (`reaper run`, or `tracker.inbox.retention.maintain`) makes ahead of
time and drops whole once expired. A Kafka consumer helper: `tracker.inbox.consumer`.
"""

from tracker.errors import NoCallerTransaction
from tracker.inbox import aio
from tracker.inbox.aio import AsyncInbox
from tracker.inbox.core import (
    TEXT_MAX,
    InboxError,
    InboxResult,
    IsolationNotSupported,
    NoInboxPartition,
)
from tracker.inbox.sync import Inbox, claim, default, run_once

__all__ = [
    "TEXT_MAX",
    "AsyncInbox",
    "Inbox",
    "InboxError",
    "InboxResult",
    "IsolationNotSupported",
    "NoCallerTransaction",
    "NoInboxPartition",
    "aio",
    "claim",
    "default",
    "run_once",
]
