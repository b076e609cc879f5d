"""Fan-out completion tracking on top of a Postgres transactional outbox.

App code: `import tracker` and `from tracker import outbox`. See README.md.
"""
from .errors import (BatchExpired, BatchNotOpen, IndexOutOfRange, InvalidIdentifier, MalformedItemId,
                     TrackerError, UnknownBatch, UnknownGroup)
from .ids import ItemId, expand, format_item_id, format_run, parse_ack, parse_item_id

__all__ = [
    "BatchExpired", "BatchNotOpen", "IndexOutOfRange", "InvalidIdentifier", "MalformedItemId", "TrackerError",
    "UnknownBatch", "UnknownGroup", "ItemId", "expand", "format_item_id", "format_run", "parse_ack", "parse_item_id",
]
