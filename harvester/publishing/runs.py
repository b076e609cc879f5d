"""Delivery reports by partition run: one report covers every record of a produce call's partition.

With the producer settings of config.REQUIRED_PRODUCER, librdkafka's idempotent producer keeps
produce() order per partition, and its gap-less guarantee means "the sequence of messages may be
cut short and fail before all messages are written, but may not fail individual messages in the
series"; only message.timeout.ms failures are exempt, and reaper sets no timeout (librdkafka
INTRODUCTION.md, "Idempotent Producer": "Guarantees", "Message timeout considerations"; a
permanent batch error fails the queued messages behind it with the fatal _GAPLESS_GUARANTEE,
"Standard errors"). So, within one partition of one producer, a record acknowledged as written
means every record produced to that partition before it was written too. Only the last record of
each partition in a produce call carries a delivery callback (the records of the run); the others
carry none, and confluent-kafka then keeps no per-record callback state and serves no report for
them. A delivered run is purged whole; a failed one is reset whole (duplicates, never loss).

That needs every record's partition known when it is produced: explicit. Rows with a
`kafka_partition` have one; for the others this module computes what librdkafka's default
partitioner (consistent_random: CRC-32 of the key modulo the partition count) would choose, and
passes it explicitly. Rows it cannot place (an empty or null key: the partitioner picks at random;
another `partitioner` configured; a topic whose partition count is unknown) keep a report each.
A topic once produced to through librdkafka's partitioner stays so on that producer until nothing
is queued any more: such records wait unassigned until the topic's metadata arrives and would
then land behind explicit records produced after them (INTRODUCTION.md, "Partitioner
considerations").
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Container, Sequence
from itertools import repeat
from operator import is_not, itemgetter

from harvester.publishing.ports import ProducerLike

DEFAULT_PARTITIONER = "consistent_random"  # librdkafka's default `partitioner`
COUNT_REFRESH = 10.0  # seconds a topic's partition count is trusted before it is looked up again
# Seconds a partition-count lookup may hold up the producing thread: a topic's first one longer (its
# records get a report each until it succeeds), a refresh shorter (the count known stays in use).
FIRST_LOOKUP_TIMEOUT = 5.0
REFRESH_TIMEOUT = 0.5
UNPLACED = -1  # librdkafka's partitioner chooses; the record keeps a report of its own
# Seconds a row of a refused run is remembered to be published with a report of its own. Its run is
# reset and marked again at once, so it normally comes back within a second; one that never comes
# back to this process (another leader took over, the row left the outbox) must not stay: every
# entry also keeps plan_runs off its one-topic fast path. Forgotten, a row is at worst published in
# a run once more, refused again and remembered again (duplicates, never loss).
ALONE_FOR = 60.0
_TOPIC, _KEY, _PARTITION = itemgetter(1), itemgetter(2), itemgetter(6)


def computes_partitions(conf: dict) -> bool:
    """Whether partitions can be computed for this producer configuration (the default partitioner)."""
    return str(conf.get("partitioner", DEFAULT_PARTITIONER)) == DEFAULT_PARTITIONER


class PartitionCounts:
    """Topic partition counts for one producer at a time, from its own metadata lookups."""

    def __init__(self) -> None:
        self._producer: ProducerLike | None = None
        self._counts: dict[str, tuple[int, float]] = {}  # topic -> (count, 0: unknown; look up again after)

    def of(self, producer: ProducerLike, topic: str) -> int:
        """The topic's partition count, or 0: unknown (its records go through librdkafka's partitioner)."""
        if producer is not self._producer:
            self._producer, self._counts = producer, {}
        now = time.monotonic()
        known = self._counts.get(topic)
        if known is not None and now < known[1]:
            return known[0]
        if known is not None and known[0] == 0 and len(producer) > 0:
            # Records sent through the partitioner may still wait unassigned: explicit ones
            # produced now could overtake them in their partition.
            self._counts[topic] = (0, now + COUNT_REFRESH)
            return 0
        refresh = known is not None and known[0] > 0
        count = self._look_up(producer, topic, REFRESH_TIMEOUT if refresh else FIRST_LOOKUP_TIMEOUT)
        if count == 0 and known is not None and known[0] > 0:
            count = known[0]  # a failed lookup: the partitions we know of still exist
        self._counts[topic] = (count, now + COUNT_REFRESH)
        return count

    def forget(self, topic: str) -> None:
        """The topic's count is wrong (produce() refused a partition computed from it): look it up again."""
        self._counts.pop(topic, None)

    @staticmethod
    def _look_up(producer: ProducerLike, topic: str, timeout: float) -> int:
        list_topics = getattr(producer, "list_topics", None)
        if list_topics is None:  # a stand-in producer without metadata
            return 0
        try:
            meta = list_topics(topic, timeout).topics.get(topic)
        except Exception:  # unreachable cluster, timeout: librdkafka's partitioner it is
            return 0
        if meta is None or meta.error is not None:
            return 0
        return len(meta.partitions)


def forget_expired(single: dict[int, float], now: float) -> None:
    """Drop the rows whose time to be remembered (row id -> monotonic time) has passed at `now`.
    Another thread may add meanwhile: the items are copied first (one C-level call under the GIL),
    and an entry renewed since is kept."""
    for row_id, until in list(single.items()):
        if until <= now and single.get(row_id) == until:
            single.pop(row_id, None)


def plan_runs(
    rows: Sequence[tuple],
    counts: PartitionCounts,
    producer: ProducerLike,
    single: dict[int, float],
    apart: Container[int] = (),
) -> tuple[list[int], list[int], list[bool]]:
    """(partition, run, last) per row: the partition to produce to (UNPLACED: the partitioner's
    choice); the row's run, one per (topic, partition) of the call, or -1 for a row reported on its
    own (unplaced, or in `single`: ids to be reported one by one, taken out of it here; the caller
    drops the expired ones first, forget_expired); and whether it is the last row of its run (the
    one whose report settles the run). Rows whose index is in `apart` (not produced: moved to the
    dead table, harvester.publishing.unfit_rows) and rows with a negative `kafka_partition` (which
    produce() would read as "the partitioner chooses") are in no run."""
    n = len(rows)
    if n and not single and not apart:
        # The common case, one topic and keyed rows without kafka_partition: computed at C speed
        # (map, comprehensions), the partition standing for the run.
        topic = rows[0][1]
        keys = list(map(_KEY, rows))
        if (
            all(keys)
            and not any(map(is_not, map(_PARTITION, rows), repeat(None)))
            and all(map(topic.__eq__, map(_TOPIC, rows)))
        ):
            cnt = counts.of(producer, topic)
            if cnt:
                parts = [c % cnt for c in map(zlib.crc32, keys)]
                last = [False] * n
                for i in {p: i for i, p in enumerate(parts)}.values():
                    last[i] = True
                return parts, parts, last
    parts = [UNPLACED] * n
    runs = [-1] * n
    last = [False] * n
    index: dict[tuple[str, int], int] = {}
    where: dict[str, int] = {}
    crc = zlib.crc32
    for i, row in enumerate(rows):
        row_id, topic, key, partition = row[0], row[1], row[2], row[6]  # a marked row's fields
        if apart and i in apart or partition is not None and partition < 0:
            single.pop(row_id, None)
            continue
        if partition is None:
            count = where.get(topic)
            if count is None:
                count = where[topic] = counts.of(producer, topic)
            if count == 0 or not key:
                single.pop(row_id, None)  # reported on its own anyway
                continue
            partition = crc(key) % count
        parts[i] = partition
        if single and row_id in single:
            single.pop(row_id, None)
            continue
        runs[i] = index.setdefault((topic, partition), len(index))
    seen: set[int] = set()
    for i in range(n - 1, -1, -1):
        r = runs[i]
        if r >= 0 and r not in seen:
            seen.add(r)
            last[i] = True
    return parts, runs, last
