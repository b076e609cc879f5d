"""Fan-out completion tracking on top of a Postgres transactional outbox.

App code: `import tracker` and `from tracker import outbox` (sync), `from tracker import aio` (asyncio):

    batch = tracker.open_batch(session, user_key="catalog-42")
    outbox.enqueue(session, batch, items, topic="process-item")
    tracker.close_batch(session, batch)          # True if already complete
    tracker.ack(session, ["17:0:5", "17:0:6-9"])  # consumers, in their own transaction (claims, settled at commit)
    tracker.status(session, batch)

`session` is a psycopg Connection or a SQLAlchemy Session/Connection (postgresql+psycopg://); in
`tracker.aio`, a psycopg AsyncConnection or a SQLAlchemy AsyncSession/AsyncConnection. Nothing
commits behind the caller's back, in any connection mode. The module-level functions use the
default tracker of `schema=` ("reaper"); for another outbox table or completion topic build a
`Tracker(schema=, outbox_table=, completion_topic=, registry=)` (or `aio.AsyncTracker`) and call
its methods.
"""

from tracker import aio, outbox
from tracker.aio import AsyncTracker
from tracker.consumer import AckProducer, MissingItemId, Processed, item_id_of
from tracker.core.acks import CLAIMS_PER_CALL_MAX, AckResult, FailResult, FailurePage
from tracker.core.batches import Batch, BatchStatus, GroupHandle
from tracker.core.validate import KAFKA_INTERNAL_TOPICS, is_topic_name
from tracker.errors import (
    BatchExpired,
    BatchNotOpen,
    CallerTransactionAborted,
    DepthExceeded,
    IndexOutOfRange,
    InvalidArgument,
    InvalidIdentifier,
    InvalidValue,
    MalformedItemId,
    ParentNotOpen,
    TooManyGroups,
    TrackerError,
    UnknownBatch,
    UnknownGroup,
    UnsupportedConnection,
)
from tracker.ids import GroupMask, IdRun, ItemId, expand, fold, format_item_id, format_run, parse_ack, parse_item_id
from tracker.message_ids import MESSAGE_ID_HEADER, message_id_of
from tracker.outbox import Message
from tracker.settle import SettleResult, settle
from tracker.sync import (
    Tracker,
    ack,
    add_items,
    apply_masks,
    apply_outcomes,
    close_batch,
    exactly_once,
    fail,
    fail_masks,
    failures,
    open_batch,
    status,
)

__all__ = [
    "is_topic_name",
    "KAFKA_INTERNAL_TOPICS",
    "Tracker",
    "AsyncTracker",
    "aio",
    "outbox",
    "open_batch",
    "add_items",
    "close_batch",
    "ack",
    "apply_masks",
    "apply_outcomes",
    "fail",
    "fail_masks",
    "failures",
    "FailResult",
    "FailurePage",
    "status",
    "settle",
    "SettleResult",
    "AckProducer",
    "exactly_once",
    "item_id_of",
    "MESSAGE_ID_HEADER",
    "message_id_of",
    "MissingItemId",
    "Processed",
    "AckResult",
    "CLAIMS_PER_CALL_MAX",
    "Batch",
    "BatchStatus",
    "GroupHandle",
    "Message",
    "BatchExpired",
    "BatchNotOpen",
    "CallerTransactionAborted",
    "DepthExceeded",
    "ParentNotOpen",
    "IndexOutOfRange",
    "InvalidArgument",
    "InvalidIdentifier",
    "InvalidValue",
    "MalformedItemId",
    "TooManyGroups",
    "TrackerError",
    "UnknownBatch",
    "UnknownGroup",
    "UnsupportedConnection",
    "GroupMask",
    "IdRun",
    "ItemId",
    "expand",
    "fold",
    "format_item_id",
    "format_run",
    "parse_ack",
    "parse_item_id",
]
