"""The one folder of acks: reading item ids and runs, checking them, and folding them into one bit
mask per (batch, group). Every Python path folds here, each keeping its own contract:

- `fold` (also `tracker.ids.fold` and `tracker.fold`): all or nothing. The first malformed entry
  raises, naming it as written; masks grow to their highest index and past `MASK_BYTES_MAX` the
  call is refused (TooManyGroups, naming the entry that took it past) before those masks exist.
- `EntryFolder` / `fold_messages`: the reaper's acker (and AckProducer): bad entries never spoil the
  good ones, each comes back with its reason (and, from Kafka, its partition and offset, so the
  acker can dead-letter it); a round holds at most `GROUPS_PER_FOLD_MAX` whole (1 KiB) masks.
- `fold_arrow`: Spark's per-partition fold of Arrow batches on the executors (pyarrow and numpy
  are imported only when it runs; this module imports nothing beyond the standard library and
  tracker.errors, so folding needs no database or Kafka client).

All three read entries through one grammar (`parse_ack`, `EntryFolder.take`): ASCII decimals
written one way only ('7', never '07'), batch and group ids within a bigint, an index below
`GROUP_BITS_MAX`. The SQL `ack` function folds the same way for SQL callers (it cannot call Python);
tests/test_fold_sql_agrees.py holds the two to the same masks and the same refusals.

Masks are laid out as Postgres lays out a bit string: index i is bit (7 - i % 8) of byte i // 8.
"""

from __future__ import annotations

from tracker.folding.arrow import fold_arrow
from tracker.folding.entries import (
    GROUP_BITS_MAX,
    GROUPS_PER_FOLD_MAX,
    ID_MAX,
    MASK_BYTES_MAX,
    OUT_OF_RANGE,
    EntryFolder,
    GroupMask,
    IdRun,
    ItemId,
    fold,
    iter_ids,
    or_bits,
    parse_ack,
    parse_item_id,
)
from tracker.folding.messages import FAIL_MARK, FAILURE_REASON_HEADER, Folded, failure_reason, fold_messages

__all__ = [
    "FAIL_MARK",
    "FAILURE_REASON_HEADER",
    "GROUP_BITS_MAX",
    "GROUPS_PER_FOLD_MAX",
    "ID_MAX",
    "MASK_BYTES_MAX",
    "OUT_OF_RANGE",
    "EntryFolder",
    "Folded",
    "GroupMask",
    "IdRun",
    "ItemId",
    "fold",
    "fold_arrow",
    "failure_reason",
    "fold_messages",
    "iter_ids",
    "or_bits",
    "parse_ack",
    "parse_item_id",
]
