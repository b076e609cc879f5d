"""Ack messages from the ack topic (the acker): folded per group, bad entries set aside with their
partition and offset, a round bounded by `GROUPS_PER_FOLD_MAX` whole masks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracker.folding.entries import _INDEX_BITS, GROUPS_PER_FOLD_MAX, EntryFolder, GroupMask, parse_ack

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
