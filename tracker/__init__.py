"""Fan-out completion tracking on top of a Postgres transactional outbox.

App code: `import tracker` and `from tracker import outbox`:

    batch = tracker.open_batch(session, user_key="catalog-42")
    outbox.enqueue(session, batch, items, topic="process-item")
    tracker.close_batch(session, batch)          # True if already complete
    tracker.ack(session, ["17:0:5", "17:0:6-9"])  # consumers, in their own transaction (claims, settled at commit)
    tracker.status(session, batch)

`session` is a SQLAlchemy Session (postgresql+psycopg://) or a psycopg Connection; nothing commits
behind the caller's back. Every function takes `schema=`; `configure()` sets the defaults.
"""
from . import outbox
from .acks import AckResult, ack, apply_masks, claim_masks
from .settler import SettleResult, settle
from .consumer import AckProducer, MissingItemId, exactly_once, item_id_of
from .batches import Batch, BatchStatus, GroupHandle, add_items, close_batch, open_batch, status
from .errors import (BatchExpired, BatchNotOpen, IndexOutOfRange, InvalidIdentifier, MalformedItemId,
                     TrackerError, UnknownBatch, UnknownGroup)
from .ids import GroupMask, IdRun, ItemId, expand, fold, format_item_id, format_run, parse_ack, parse_item_id
from .outbox import Message
from .session import configure

__all__ = [
    "outbox", "open_batch", "add_items", "close_batch", "ack", "apply_masks", "claim_masks", "settle", "SettleResult",
    "status", "configure",
    "AckProducer", "exactly_once", "item_id_of", "MissingItemId",
    "AckResult", "Batch", "BatchStatus", "GroupHandle", "Message",
    "BatchExpired", "BatchNotOpen", "IndexOutOfRange", "InvalidIdentifier", "MalformedItemId", "TrackerError",
    "UnknownBatch", "UnknownGroup", "GroupMask", "IdRun", "ItemId", "expand", "fold", "format_item_id",
    "format_run", "parse_ack", "parse_item_id",
]
