"""Entries: the grammar of item ids and runs, masks, and the all-or-nothing fold (`fold`,
`EntryFolder`)."""

from __future__ import annotations

import re
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import add
from typing import NamedTuple

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
if _PLAIN_IDS.fullmatch("1:0:1\n1:0:2") is None:
    # CPython before 3.11.5 (Debian 12's python3 is 3.11.2) mismatches possessive repeats of groups:
    # every call would take the slow path. The same pattern, backtracking, matches alike there.
    _PLAIN_IDS = re.compile(rf"(?:{_DECIMAL}:{_DECIMAL}:[0-9]{{1,4}}\n)*{_DECIMAL}:{_DECIMAL}:[0-9]{{1,4}}")


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
