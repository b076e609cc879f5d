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

import re
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import repeat
from operator import add
from typing import Any, NamedTuple

from tracker.errors import IndexOutOfRange, MalformedItemId, TooManyGroups

GROUP_BITS_MAX = 8192  # a group's bitfield stays <= 1 KiB so it is never TOASTed
ID_MAX = (1 << 63) - 1  # batch and group ids are Postgres bigints
# What one fold may allocate for masks, whatever the ids name: 4 MiB, at least 4,096 whole groups
# (33.5 million items). A mask grows only to its highest index, so small groups cost bytes, not
# kilobytes; a call past the limit is refused (TooManyGroups) before the masks past it exist.
MASK_BYTES_MAX = 4 << 20
# Whole groups (1 KiB masks) that fit in MASK_BYTES_MAX: what the acker and Spark hold in one round.
GROUPS_PER_FOLD_MAX = MASK_BYTES_MAX // (GROUP_BITS_MAX >> 3)
OUT_OF_RANGE = f"index out of range: no group holds more than {GROUP_BITS_MAX} items"
# The bulk path lays one flag byte per possible bit of every group named end to end (8 KiB a
# group); past this many groups it gives way to the per-entry fold, which grows masks by need.
_PLAIN_GROUPS_MAX = 128

__all__ = [
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
    "fold_messages",
    "iter_ids",
    "or_bits",
    "parse_ack",
    "parse_item_id",
]

# ---------------------------------------------------------------- the grammar

# The canonical spelling of a decimal id and of an index (no leading zero; at most 19 and 4
# digits, so no token can be a huge number; values past a bigint are checked apart). Shared by the
# bulk fold's Python regex and the Arrow fold's RE2 one.
_DECIMAL = r"(?:0|[1-9][0-9]{0,18})"
_INDEX = r"(?:0|[1-9][0-9]{0,3})"
# The canonical spelling of every index a group can hold, as str, and as bytes -> (byte, bit,
# index) in a mask: one dict lookup instead of a digit check, an int() and two shifts per id (the
# acker's fold of 1M single-id messages: 0.71 s -> 0.53 s). Anything else is not in them and
# takes the validating path.
_INDEX_OF = {str(i): i for i in range(GROUP_BITS_MAX)}
_INDEX_BITS: dict[bytes, tuple[int, int, int]] = {
    str(i).encode(): (i >> 3, 0x80 >> (i & 7), i) for i in range(GROUP_BITS_MAX)
}


class ItemId(NamedTuple):
    batch_id: int
    group_id: int
    index: int  # type: ignore[assignment]  # public field name; shadowing tuple.index is intended

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.group_id}:{self.index}"


def _canonical(text: str, whole: object) -> None:
    # str.isdigit accepts non-ASCII digits; ids are plain ASCII decimal, written one way only:
    # '7', never '07' (which two readers could take for two different ids).
    if not text or not text.isascii() or not text.isdigit():
        raise MalformedItemId(whole, f"{text!r} is not a non-negative decimal")
    if len(text) > 1 and text[0] == "0":
        raise MalformedItemId(whole, f"{text[:24]!r} has a leading zero: ids are written as plain decimals")


def _nonneg(text: str, whole: object, limit: int = ID_MAX, what: str = "id") -> int:
    _canonical(text, whole)
    # Bounded before int(): a 10,000-digit "id" must not cost a big-integer conversion.
    if len(text) > 19 or int(text) > limit:
        raise MalformedItemId(whole, f"{what} {text[:24]} is larger than {limit}")
    return int(text)


def _index(text: str, whole: object) -> int:
    # No group holds more than GROUP_BITS_MAX items: a larger index can never be valid, and must
    # not make a fold allocate a mask for it.
    _canonical(text, whole)
    digits = text
    if len(digits) > 4 or int(digits) >= GROUP_BITS_MAX:
        raise IndexOutOfRange(whole if isinstance(whole, str) else repr(whole), GROUP_BITS_MAX, any_group=True)
    return int(digits)


def parse_item_id(item_id: str | bytes) -> ItemId:
    """Parse one item id; raises MalformedItemId naming it."""
    text = _as_text(item_id)
    parts = text.split(":")
    if len(parts) != 3:
        raise MalformedItemId(item_id, "needs exactly three ':'-separated parts")
    return ItemId(_nonneg(parts[0], item_id), _nonneg(parts[1], item_id), _index(parts[2], item_id))


class IdRun(NamedTuple):
    """Indexes start..end (inclusive) of one group."""

    batch_id: int
    group_id: int
    start: int
    end: int


def parse_ack(ack: str | bytes) -> IdRun:
    """Parse an item id or the run form '<b>:<g>:<start>-<end>' into a run."""
    text = _as_text(ack)
    parts = text.split(":")
    if len(parts) != 3:
        raise MalformedItemId(ack, "needs exactly three ':'-separated parts")
    batch_id, group_id = _nonneg(parts[0], ack), _nonneg(parts[1], ack)
    start_s, dash, end_s = parts[2].partition("-")
    start = _index(start_s, ack)
    end = _index(end_s, ack) if dash else start
    if end < start:
        raise MalformedItemId(ack, f"run end {end} is before its start {start}")
    return IdRun(batch_id, group_id, start, end)


def _as_text(value: str | bytes) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("ascii")
        except UnicodeDecodeError:
            raise MalformedItemId(value, "not ASCII") from None
    if not isinstance(value, str):
        raise MalformedItemId(value, f"expected str or bytes, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------- masks


@dataclass(slots=True)  # no per-instance dict: a fold may hold many thousands
class GroupMask:
    """Indexes of one group folded into a bitfield, laid out as Postgres lays out a bit string:
    index i is bit (7 - i % 8) of byte i // 8, i.e. counted from the left."""

    batch_id: int
    group_id: int
    bits: bytearray
    max_index: int = -1
    count: int = 0  # ids folded in, duplicates included

    def add(self, start: int, end: int) -> None:
        need = end // 8 + 1
        if need > len(self.bits):
            self.bits.extend(bytes(need - len(self.bits)))
        bits = self.bits
        if end - start < 64:
            for i in range(start, end + 1):
                bits[i >> 3] |= 0x80 >> (i & 7)
        else:
            # Set a long run byte-wise: head bits, whole bytes, tail bits.
            i = start
            while i <= end and i & 7:
                bits[i >> 3] |= 0x80 >> (i & 7)
                i += 1
            whole_end = (end + 1) >> 3
            if i >> 3 < whole_end:
                bits[i >> 3 : whole_end] = b"\xff" * (whole_end - (i >> 3))
                i = whole_end << 3
            while i <= end:
                bits[i >> 3] |= 0x80 >> (i & 7)
                i += 1
        if end > self.max_index:
            self.max_index = end
        self.count += end - start + 1

    def merge(self, other: GroupMask) -> None:
        """OR another mask of the same group into this one."""
        if len(other.bits) > len(self.bits):
            self.bits.extend(bytes(len(other.bits) - len(self.bits)))
        for i, byte in enumerate(other.bits):
            self.bits[i] |= byte
        self.max_index = max(self.max_index, other.max_index)
        self.count += other.count

    @classmethod
    def of_bits(cls, batch_id: int, group_id: int, bits: bytes, count: int) -> GroupMask:
        """A mask from its packed bits (as Spark's reduce carries them), its highest index found."""
        max_index = -1
        for i in range(len(bits) - 1, -1, -1):
            byte = bits[i]
            if byte:
                max_index = i * 8 + 7 - ((byte & -byte).bit_length() - 1)
                break
        return cls(batch_id, group_id, bytearray(bits), max_index, count)

    def hex(self) -> str:
        return self.bits.hex()

    def item_id(self, index: int) -> str:
        return f"{self.batch_id}:{self.group_id}:{index}"

    def indexes(self, lo: int = 0) -> Iterator[int]:
        """The set indexes at or above `lo`, ascending (whole zero bytes are skipped)."""
        bits = self.bits
        for byte_no in range(lo >> 3, len(bits)):
            byte = bits[byte_no]
            if byte:
                for bit in range(8):
                    i = byte_no * 8 + bit
                    if byte & (0x80 >> bit) and i >= lo:
                        yield i


def iter_ids(masks: Iterable[GroupMask]) -> Iterator[str]:
    """Every index set in the masks, as item ids (for tests and dead-letter reporting)."""
    for m in masks:
        for i in m.indexes():
            yield m.item_id(i)


def or_bits(a: tuple[bytes, int], b: tuple[bytes, int]) -> tuple[bytes, int]:
    """OR two (packed bits, ids folded) of one group, as Spark's reduce combines partitions' masks."""
    n = max(len(a[0]), len(b[0]))
    merged = (int.from_bytes(a[0].ljust(n, b"\0"), "big") | int.from_bytes(b[0].ljust(n, b"\0"), "big")).to_bytes(
        n, "big"
    )
    return merged, a[1] + b[1]


# ---------------------------------------------------------------- folding entries


class EntryFolder:
    """Folds ack entries (item ids and runs, as text) into one mask per (batch, group): the one entry
    fold behind every path. `take` raises on a bad entry, naming it; `add` returns its reason
    instead, so one bad entry never spoils the others.

    Masks are whole (1 KiB) by default: the caller bounds how many groups it holds (the acker's
    rounds, Spark's emissions). With `max_mask_bytes` they grow to their highest index instead, and
    `take` returns False, allocating nothing, for the entry that would take them past it."""

    __slots__ = ("masks", "_heads", "_room")

    def __init__(self, max_mask_bytes: int | None = None) -> None:
        self.masks: dict[tuple[int, int], GroupMask] = {}
        self._heads: dict[str, tuple[int, int]] = {}  # '<batch>:<group>' as written -> its key
        self._room = max_mask_bytes  # None: whole masks

    def take(self, entry: str) -> bool:
        """Fold one entry; raises MalformedItemId or IndexOutOfRange naming it. False (nothing
        folded) if its mask would take the masks past `max_mask_bytes`."""
        head, sep, tail = entry.rpartition(":")
        key = self._heads.get(head)
        # The common case: another index of a group already seen, written canonically.
        start = None if key is None else _INDEX_OF.get(tail)
        if key is None or start is None:
            run = parse_ack(entry)
            key = (run.batch_id, run.group_id)
            if sep:
                self._heads[head] = key
            start, end = run.start, run.end
        else:
            end = start
        mask = self.masks.get(key)
        if self._room is None:
            if mask is None:
                mask = self.masks[key] = GroupMask(key[0], key[1], bytearray(GROUP_BITS_MAX >> 3))
        else:
            have = 0 if mask is None else len(mask.bits)
            need = (end >> 3) + 1
            if need > have:  # checked before the mask grows
                if need - have > self._room:
                    return False
                self._room -= need - have
            if mask is None:
                mask = self.masks[key] = GroupMask(key[0], key[1], bytearray())
        mask.add(start, end)
        return True

    def add(self, entry: str) -> str | None:
        """Fold one entry into whole masks; its reason if it is refused, else None."""
        try:
            self.take(entry)
        except MalformedItemId as exc:
            return f"malformed: {exc}"
        except IndexOutOfRange:  # an index no group can hold: never a mask for it
            return OUT_OF_RANGE
        return None


def fold(acks: Iterable[str | bytes], *, max_mask_bytes: int = MASK_BYTES_MAX) -> dict[tuple[int, int], GroupMask]:
    """Fold item ids and runs into one mask per (batch, group). Raises MalformedItemId on the first
    malformed entry, before anything could be applied, and TooManyGroups if the masks would take
    more than `max_mask_bytes`: memory is the ids' own size plus at most that, whatever they name."""
    acks = acks if isinstance(acks, list) else list(acks)
    if not acks:
        return {}
    masks = _fold_plain_ids(acks)
    if masks is not None and sum(len(m.bits) for m in masks.values()) <= max_mask_bytes:
        return masks
    return _fold_each(acks, max_mask_bytes)  # also the one that names the entry past the limit


_TO_DIGITS = bytes([48, 49]) + bytes(254)  # flag bytes 0/1 -> b'0'/b'1', for int(..., 2)
# Plain ids, one per line (the bulk fold's check): possessive repetition, so one linear pass. An
# index with a leading zero passes here and is caught by _INDEX_OF; values past a bigint below.
_ID = _DECIMAL.replace("}", "}+")  # possessive: measured ~15% faster here than backtracking digits
_PLAIN_IDS = re.compile(rf"(?:{_ID}:{_ID}:[0-9]{{1,4}}+\n)*+{_ID}:{_ID}:[0-9]{{1,4}}+")


def _fold_plain_ids(acks: list) -> dict[tuple[int, int], GroupMask] | None:
    """The bulk case, with no Python-level loop per id: plain '<b>:<g>:<i>' ids (all str or all
    bytes), every index written canonically and < 8192. Returns None when anything else is
    present (runs, malformed entries, odd types): `_fold_each` then folds the call and names the
    culprit."""
    try:
        text = "\n".join(acks) if type(acks[0]) is str else b"\n".join(acks).decode("ascii")
    except (TypeError, UnicodeDecodeError):
        return None
    n = len(acks)
    # An entry with a newline inside would read as two ids: the slow path names it as malformed.
    if _PLAIN_IDS.fullmatch(text) is None or text.count("\n") != n - 1:
        return None
    # Usually one batch: strip its prefix and split lines of "<group>:<index>" into 2n tokens.
    batch_prefix = text[: text.index(":") + 1]
    if text.count("\n" + batch_prefix) == n - 1:
        tokens = text[len(batch_prefix) :].replace("\n" + batch_prefix, ":").split(":")
        keys, indexes = tokens[0::2], tokens[1::2]
        single_batch: int | None = int(batch_prefix[:-1])
    else:
        tokens = text.replace("\n", ":").split(":")
        keys = list(map(add, map(add, tokens[0::3], repeat(":")), tokens[1::3]))
        indexes = tokens[2::3]
        single_batch = None
    del text, tokens
    groups = dict.fromkeys(keys)
    if len(groups) > _PLAIN_GROUPS_MAX:
        return None  # many groups: the per-entry fold sizes each mask by its highest index
    # One flag byte per possible bit of every group named, the groups laid end to end.
    offsets = {key: k * GROUP_BITS_MAX for k, key in enumerate(groups)}
    del groups
    flags = bytearray(len(offsets) * GROUP_BITS_MAX)
    try:
        positions = map(add, map(offsets.__getitem__, keys), map(_INDEX_OF.__getitem__, indexes))
        deque(map(flags.__setitem__, positions, repeat(1)), maxlen=0)
    except KeyError:
        return None  # an index no group can hold, or spelt with leading zeros
    del indexes
    masks: dict[tuple[int, int], GroupMask] = {}
    for key, offset in offsets.items():
        if single_batch is not None:
            batch_id, group_id = single_batch, int(key)
        else:
            b, _, g = key.partition(":")
            batch_id, group_id = int(b), int(g)
        if batch_id > ID_MAX or group_id > ID_MAX:
            return None  # `_fold_each` raises, naming the id
        last = flags.rfind(1, offset, offset + GROUP_BITS_MAX) - offset
        nbytes = (last >> 3) + 1
        value = int(flags[offset : offset + nbytes * 8].translate(_TO_DIGITS), 2)
        masks[(batch_id, group_id)] = GroupMask(
            batch_id, group_id, bytearray(value.to_bytes(nbytes, "big")), last, value.bit_count()
        )
    if sum(m.count for m in masks.values()) != n:
        # Some id came twice: count ids, not bits, per group (duplicates are reported as such).
        counts = Counter(keys)
        for m in masks.values():
            m.count = 0
        for key, count in counts.items():
            if single_batch is not None:
                masks[(single_batch, int(key))].count += count
            else:
                b, _, g = key.partition(":")
                masks[(int(b), int(g))].count += count
    return masks


def _fold_each(acks: Iterable[str | bytes], max_mask_bytes: int = MASK_BYTES_MAX) -> dict[tuple[int, int], GroupMask]:
    """One entry at a time: runs, bytes, anything. Raises on the first malformed entry; else, if
    the masks would pass `max_mask_bytes`, TooManyGroups naming the entry that takes them past it
    (the entries after it are only checked, never allocated for: malformed ones are named first,
    as the SQL ack does)."""
    folder = EntryFolder(max_mask_bytes)
    take = folder.take
    past: str | bytes | None = None  # the entry that took the masks past the limit
    for ack in acks:
        text = ack if type(ack) is str else _as_text(ack)
        if past is not None:
            parse_ack(text)  # raises on a malformed entry; nothing more is allocated
        elif not take(text):
            past = ack
            folder.masks.clear()
    if past is not None:
        raise TooManyGroups("item_ids", past, max_mask_bytes)
    return folder.masks


# ---------------------------------------------------------------- Kafka messages (the acker)


@dataclass
class Folded:
    """A poll's acks folded per group, the entries set aside, and how far each partition got."""

    masks: dict[tuple[int, int], GroupMask] = field(default_factory=dict)
    bad: list[tuple[bytes | None, bytes | None, str, int, int]] = field(
        default_factory=list
    )  # key, entry, reason, partition, offset
    first: dict[int, int] = field(default_factory=dict)  # partition -> first offset in the poll
    last: dict[int, int] = field(default_factory=dict)  # partition -> last offset in the poll
    messages: int = 0
    errors: list[Any] = field(default_factory=list)  # KafkaErrors the poll returned instead of messages
    rest: list[Any] = field(default_factory=list)  # messages left for the next fold (the bound was reached)


def fold_messages(messages: list[Any], *, max_groups: int = GROUPS_PER_FOLD_MAX, room: int | None = None) -> Folded:
    """Fold ack messages into masks, tolerating bad entries (kept in `.bad` with their reason).

    Bounded whatever the messages name: masks are 1 KiB a group, and a fold stops before the
    message that would take it past `room` groups (default `max_groups`; never at the first
    message, so every fold makes progress), leaving it and those after it in `.rest` for the next
    fold (fold, apply and commit, then fold the rest). A message that alone names more than
    `max_groups` groups is set aside whole as too large."""
    room = max_groups if room is None else room
    out = Folded()
    folder = EntryFolder()
    out.masks = masks = folder.masks
    bad, first, last, add = out.bad, out.first, out.last, folder.add
    # Fast path, most messages: one item id of a group already seen in this fold. Works on the
    # raw bytes; anything else takes the validating path.
    by_head: dict[bytes, GroupMask] = {}
    index_bits = _INDEX_BITS
    count = 0
    # A poll returns runs of messages from one partition: offsets are read at run boundaries.
    current, previous = -1, None  # -1: no partition yet (a consumed message always has one)
    for position, msg in enumerate(messages):
        err = msg.error()
        if err is not None:
            out.errors.append(err)
            continue
        value = msg.value()
        if value is not None:
            head, _, tail = value.rpartition(b":")
            mask = by_head.get(head)
            if mask is not None:
                bit = index_bits.get(tail)
                if bit is not None:
                    # The offset bookkeeping below is written out here and again on the validating
                    # path on purpose: sharing it costs this loop ~10% (1M messages: 0.33 -> 0.37 s).
                    partition = msg.partition()
                    if partition != current:
                        if previous is not None:
                            last[current] = previous.offset()
                        current = partition
                        if partition not in first:
                            first[partition] = msg.offset()
                    previous = msg
                    count += 1
                    mask.bits[bit[0]] |= bit[1]  # masks are created full size (1 KiB)
                    mask.count += 1
                    if bit[2] > mask.max_index:
                        mask.max_index = bit[2]
                    continue
        # The validating path: decode, split, check the bound, then fold entry by entry.
        entries: list[str] = []
        reason = None
        try:
            entries = value.decode("ascii").split(",")
        except (AttributeError, UnicodeDecodeError):
            reason = "malformed: value is empty or not ASCII"
        else:
            # Each entry names at most one new group; counted exactly only when that bound says
            # this message might not fit. Stop before a message that would take the fold past
            # `room` (never at the first: every fold makes progress).
            new = len(entries)
            if new > max_groups or (masks and len(masks) + new > room):
                new = _new_groups(entries, masks)
            if new > max_groups:
                reason = f"too large: names more than {max_groups} groups; split it"
            elif masks and len(masks) + new > room:
                out.rest = messages[position:]
                break
        partition = msg.partition()
        assert partition is not None
        if partition != current:
            if previous is not None:
                last[current] = previous.offset()
            current = partition
            if partition not in first:
                first[partition] = msg.offset()
        previous = msg
        count += 1
        if reason is not None:
            bad.append((msg.key(), value, reason, partition, msg.offset()))
            continue
        for entry in entries:
            reason = add(entry)
            if reason is not None:
                bad.append((msg.key(), entry.encode(), reason, partition, msg.offset()))
        if len(entries) == 1 and reason is None and "-" not in entries[0]:
            parsed = parse_ack(entries[0])
            by_head[value.rpartition(b":")[0]] = masks[(parsed.batch_id, parsed.group_id)]
    if previous is not None:
        last[current] = previous.offset()
    out.messages = count
    return out


def _new_groups(entries: list[str], masks: dict[tuple[int, int], GroupMask]) -> int:
    """How many groups the entries name that the fold does not hold yet (a head that does not
    parse counts as new: it is at worst set aside)."""
    new: set[object] = set()
    for head in {e.rpartition(":")[0] for e in entries}:
        b, _, g = head.partition(":")
        plain = 0 < len(b) <= 19 and 0 < len(g) <= 19 and (b + g).isascii() and (b + g).isdigit()
        key: object = (int(b), int(g)) if plain else head
        if key not in masks:
            new.add(key)
    return len(new)


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
    name: once the masks held reach `max_groups` groups (1 KiB each) they are emitted and the fold
    starts afresh; the groups' masks from several emissions are OR-ed by the reduce that follows."""

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
            return len(folder.masks) + len(plain_groups)

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
