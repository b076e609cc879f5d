"""Arrow batches on Spark executors: the per-partition fold (pyarrow and numpy are imported only
when it runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from tracker.folding.entries import _DECIMAL, _INDEX, GROUP_BITS_MAX, GROUPS_PER_FOLD_MAX, ID_MAX, EntryFolder

# ---------------------------------------------------------------- Arrow batches (Spark executors)


# A plain id: '<batch>:<group>:<index>', canonical decimals (no leading zero), the index at most 4
# digits (RE2 runs it fast; the bigint bound is checked apart, on the digit strings: equal lengths
# compare like numbers). Anything else takes the checked path, which names it.
_SHAPE = rf"^{_DECIMAL}:{_DECIMAL}:{_INDEX}$"
_BIGINT_MAX = str(ID_MAX)


def _plain_ids(values: Any) -> tuple[Any, Any, Any]:
    """(mask of plain ids in range, their '<batch>:<group>' heads, their indexes) for an Arrow
    string or binary array; the mask is over `values`, heads and indexes over the masked ones."""
    import pyarrow as pa
    import pyarrow.compute as pc

    plain = pc.fill_null(pc.match_substring_regex(values, _SHAPE), False)
    if not pc.any(plain).as_py():
        return plain, None, None
    cand = values.filter(plain)
    if not pa.types.is_string(cand.type):
        cand = cand.cast(pa.string())  # only ASCII digits and ':' are left
    parts = pc.split_pattern(cand, ":")
    batch, group, index = (pc.list_element(parts, k) for k in range(3))

    def fits(digits: Any) -> Any:
        return pc.or_(pc.less(pc.utf8_length(digits), 19), pc.less_equal(digits, _BIGINT_MAX))

    index = pc.cast(index, pa.int64())
    ok = pc.and_(pc.and_(fits(batch), fits(group)), pc.less(index, GROUP_BITS_MAX))
    if not pc.all(ok).as_py():  # out of range: left to the checked path, which names them
        mask = plain.to_numpy(zero_copy_only=False).copy()
        mask[pc.indices_nonzero(plain).filter(pc.invert(ok)).to_numpy()] = False
        plain = pa.array(mask)
        batch, group, index = batch.filter(ok), group.filter(ok), index.filter(ok)
    heads = pc.binary_join_element_wise(batch, group, ":")
    return plain, heads, index


# A message that lists entries (AckProducer packs thousands per message) in only the characters
# ids and runs are made of: split and flattened in Arrow, so its plain ids take the vectorised path
# too. Every other message (null, non-ASCII, anything else) is checked whole, as before.
_LISTED = r"^[0-9:,-]*,[0-9:,-]*$"


def _listed_entries(values: Any) -> tuple[Any, Any]:
    """(mask of messages that are lists of entries, their entries flattened) for an Arrow string
    or binary array; entries is None when no message is a list."""
    import pyarrow.compute as pc

    listed = pc.fill_null(pc.match_substring_regex(values, _LISTED), False)
    if not pc.any(listed).as_py():
        return listed, None
    return listed, pc.list_flatten(pc.split_pattern(values.filter(listed), ","))


def _fold_single_ids(heads: Any, indexes: Any) -> list[tuple[int, int, bytes, int]]:
    """Vectorised fold of plain item ids split into '<batch>:<group>' heads (Arrow strings) and
    indexes (< GROUP_BITS_MAX): (batch, group, packed mask, ids folded) per group."""
    import numpy as np
    import pyarrow.compute as pc

    encoded = pc.dictionary_encode(heads)
    codes = encoded.indices.to_numpy()
    groups = encoded.dictionary.to_pylist()
    # Set bits straight into the packed masks (1 KiB a group, as the acker's): a bool matrix first
    # would take 8 KiB a group, which many small groups in one partition turn into gigabytes.
    # Bit order "big": index 0 is the high bit of byte 0, as in varbit.
    packed = np.zeros((len(groups), GROUP_BITS_MAX >> 3), dtype=np.uint8)
    np.bitwise_or.at(packed, (codes, indexes >> 3), (0x80 >> (indexes & 7)).astype(np.uint8))
    counts = np.bincount(codes, minlength=len(groups))
    out = []
    for j, head in enumerate(groups):
        batch_id, group_id = head.split(b":" if isinstance(head, bytes) else ":")
        out.append((int(batch_id), int(group_id), packed[j].tobytes(), int(counts[j])))
    return out


_FOLD_SCHEMA = (
    ("batch_id", "int64"),
    ("group_id", "int64"),
    ("mask", "binary"),
    ("folded", "int64"),
    ("bad", "string"),
    ("reason", "string"),
)


def fold_arrow(column: str, max_groups: int = GROUPS_PER_FOLD_MAX) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """The fold of one partition's Arrow batches (Spark's mapInArrow), rows as in _FOLD_SCHEMA:
    a mask per group, or a bad entry with its reason. Plain ids take a vectorised path; runs,
    lists, nulls and bad ones go through EntryFolder. Its memory is bounded whatever the ids
    name: once the masks held (1 KiB each) and the bad entries held reach `max_groups` together
    they are emitted and the fold starts afresh; the groups' masks from several emissions are OR-ed by the reduce that follows."""

    def fold_partition(batches: Iterator[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa
        import pyarrow.compute as pc

        folder = EntryFolder()
        heads: list[Any] = []
        indexes: list[Any] = []
        plain_groups: set[Any] = set()  # the plain ids' '<batch>:<group>' heads held
        bad: list[str] = []
        reasons: list[str] = []
        schema = pa.schema([(name, getattr(pa, kind)()) for name, kind in _FOLD_SCHEMA])

        def emit() -> Any:
            nonlocal folder, heads, indexes, plain_groups, bad, reasons
            folded = [(m.batch_id, m.group_id, bytes(m.bits), m.count) for m in folder.masks.values()]
            if heads:
                folded += _fold_single_ids(pa.concat_arrays(heads), np.concatenate(indexes))
            out = pa.RecordBatch.from_pydict(
                {
                    "batch_id": [f[0] for f in folded] + [None] * len(bad),
                    "group_id": [f[1] for f in folded] + [None] * len(bad),
                    "mask": [f[2] for f in folded] + [None] * len(bad),
                    "folded": [f[3] for f in folded] + [None] * len(bad),
                    "bad": [None] * len(folded) + bad,
                    "reason": [None] * len(folded) + reasons,
                },
                schema=schema,
            )
            folder, heads, indexes, plain_groups, bad, reasons = EntryFolder(), [], [], set(), [], []
            return out

        def held() -> int:
            # bad entries count too: a partition of nothing but bad ones is emitted in rounds as well
            return len(folder.masks) + len(plain_groups) + len(bad)

        def take_plain(values: Any) -> Any:
            """File the plain ids in range for the vectorised fold; return the other values."""
            plain, head, index = _plain_ids(values)
            if head is None:
                return values
            heads.append(head)
            indexes.append(index.to_numpy())
            plain_groups.update(pc.unique(head).to_pylist())
            return values.filter(pc.invert(plain))

        def checked(entry: str, reason: str | None = None) -> None:
            if reason is None:
                reason = folder.add(entry)
            if reason is not None:
                bad.append(entry)
                reasons.append(reason)

        # Slices of at most max_groups values or entries: a slice adds at most that many groups, so
        # the fold never holds more than twice the bound (a batch of 10,000 rows is one slice).
        for b in batches:
            col = b.column(column)
            for first in range(0, len(col), max_groups):
                # Plain ids in range take the vectorised path; runs, lists, nulls and bad ones the checked one.
                values = take_plain(col.slice(first, max_groups))
                if held() >= max_groups:
                    yield emit()
                listed, entries = _listed_entries(values)
                if entries is not None:
                    values = values.filter(pc.invert(listed))
                    for at in range(0, len(entries), max_groups):
                        # runs, empty and out-of-range entries: ASCII only
                        for entry in take_plain(entries.slice(at, max_groups)).to_pylist():
                            checked(entry.decode("ascii") if isinstance(entry, bytes) else entry)
                        if held() >= max_groups:
                            yield emit()
                for value in values.to_pylist():
                    if value is None:
                        checked("", "malformed: null")
                        continue
                    if isinstance(value, bytes):  # a binary column (e.g. a Kafka value)
                        value = value.decode("ascii", "replace")
                    if not value.isascii():
                        checked(value, "malformed: not ASCII")
                        continue
                    for entry in value.split(","):
                        checked(entry)
                        if held() >= max_groups:
                            yield emit()
        yield emit()

    return fold_partition
