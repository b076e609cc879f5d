"""`outbox.enqueue(session, batch, items, topic=...)`: one outbox message per item plus the groups
tracking them, in the caller's transaction, written with binary COPY.

Every row carries the headers `item-id` and `batch-id`. `enqueue` is the sync face's
(`tracker.sync`, the default tracker of `schema=`); the asyncio one is `tracker.aio.enqueue`.
The operation itself (checks, COPY encoding) is tracker/core/enqueue.py.
"""

from __future__ import annotations

from tracker.core.enqueue import Headers, HeaderValue, Item, Key, KeyArg, Message
from tracker.sync import enqueue

__all__ = ["Message", "enqueue", "Headers", "HeaderValue", "Item", "Key", "KeyArg"]
