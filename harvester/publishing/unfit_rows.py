"""Rows an outbox table can hold but that cannot be published as written: found before they are
produced, and moved to the dead table with a reason, so they hold up nothing behind them.

- A header array with more than one dimension: confluent-kafka refuses a list as a header value
  (TypeError, which stopped the producing thread) and publishes a list given as a name as its
  text (`"['a']"`).
- A NULL header name: confluent-kafka would publish it as the name `"None"`.
- A `kafka_partition` that is not a partition number (0 to 2^31 - 1): produce() takes -1 as "the
  partitioner chooses", another negative number fails the record later, and a larger one
  raises OverflowError.

A table made by `reaper migrate` refuses such rows (sql/0024_outbox_headers_flat.sql); an
application's own table, or rows written before that migration, may still hold them.

Every row goes through the same screen, so it must cost next to nothing: the whole produce call's
header names are joined at C speed (a name that is not text makes the join raise), and its
explicit partitions' range taken; only a call where that finds something is looked at row by row.
A header_values array of more than one dimension passes the screen with well-formed names; its
produce() raises TypeError for that record alone, and the produce loop moves the row aside the
same way (harvester.publishing.idempotent).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import itemgetter

PARTITION_MAX = 2**31 - 1  # Kafka's partition numbers are int32
_HEADER_KEYS, _PARTITION = itemgetter(4), itemgetter(6)


def unfit_rows(rows: Sequence[tuple]) -> dict[int, str]:
    """Index -> reason for each marked row (OutboxStore.mark's tuples) that cannot be produced as
    written; empty (the common case) when there is none."""
    try:
        try:
            "".join(chain.from_iterable(map(_HEADER_KEYS, rows)))
        except TypeError:  # a name that is not text (NULL, a nested array), or header_keys NULL
            # An application's table may let header_keys be NULL (no headers): only names count.
            "".join(chain.from_iterable(filter(None, map(_HEADER_KEYS, rows))))
    except TypeError:
        pass
    else:
        partitions = list(map(_PARTITION, rows))
        unset = partitions.count(None)
        if unset == len(partitions):
            return {}  # the common case: no explicit partition
        given = [p for p in partitions if p is not None] if unset else partitions
        if min(given) >= 0 and max(given) <= PARTITION_MAX:  # an integer column: ints
            return {}
    found: dict[int, str] = {}
    for i, row in enumerate(rows):
        reason = unfit_reason(row[4], row[5], row[6])
        if reason is not None:
            found[i] = reason
    return found


def unfit_reason(names: object, values: object, partition: object) -> str | None:
    """Why a row with these header_keys, header_values and kafka_partition cannot be produced as
    written, or None. Each reason names the column and the value, never the payload."""
    names = [] if names is None else names
    values = [] if values is None else values
    if not isinstance(names, list) or any(isinstance(n, list) for n in names):
        return "header_keys is not a one-dimensional array: Kafka headers are a flat list of names"
    if not isinstance(values, list) or any(isinstance(v, list) for v in values):
        return "header_values is not a one-dimensional array: Kafka headers are a flat list of values"
    for at, name in enumerate(names, 1):
        if name is None:
            return f"header name {at} (of header_keys) is NULL: a Kafka header needs a name"
        if not isinstance(name, str):
            return f"header name {at} (of header_keys) is not text: {type(name).__name__}"
    for at, value in enumerate(values, 1):
        if value is not None and not isinstance(value, (bytes, str)):
            return f"header value {at} (of header_values) is not bytes: {type(value).__name__}"
    if partition is not None and not (isinstance(partition, int) and 0 <= partition <= PARTITION_MAX):
        return f"kafka_partition {partition!r} is not a partition number (0 to {PARTITION_MAX}; NULL: the partitioner chooses)"
    return None
