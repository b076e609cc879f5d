"""Ack messages from the ack topic (the acker): folded per group, bad entries set aside with their
partition and offset, a round bounded by `GROUPS_PER_FOLD_MAX` whole masks.

An entry is an ack, or, written with a leading `!`, a failure under the reason its message carries
in the `failure-reason` header (1 to 500 characters of UTF-8, checked as `tracker.fail` checks a
reason). The fold keeps each batch's outcomes in the order they were read: `Folded.steps` lists
(reason or None for acks, masks) in the order to apply them, a batch's acks and failures in
successive steps each time its outcome changes, so applying the steps in order records what
applying the messages one by one would (the first outcome of an item wins)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracker.core.validate import check_reason
from tracker.errors import TrackerError
from tracker.folding.entries import _INDEX_BITS, GROUP_BITS_MAX, GROUPS_PER_FOLD_MAX, EntryFolder, GroupMask, parse_ack

# An entry written `!<item id or run>` is a failure, under the reason in its message's header:
FAIL_MARK = "!"
FAILURE_REASON_HEADER = "failure-reason"

# ---------------------------------------------------------------- Kafka messages (the acker)

_NO_HEADS: dict[bytes, tuple[GroupMask, bytearray, bytearray]] = {}  # never written
GROUP_BITS_BYTES = GROUP_BITS_MAX >> 3
# A message's bad entries set aside one by one, each with its reason (a dead letter each); past
# this many, the message is set aside once, whole, with a count: a message of many bad entries
# ("x,x,x,...") would otherwise cost a tuple and a letter per two bytes it sent.
BAD_ENTRIES_MAX = 100


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
    # (reason, masks) in the order to apply them: reason None for acks, else the failures' reason.
    # `masks` above is the first step's acks: every ack of a fold that holds no failure.
    steps: list[tuple[str | None, dict[tuple[int, int], GroupMask]]] = field(default_factory=list)
    # index in `bad` -> the failure-reason header of a failure entry's message (as received), so
    # its dead letter can be sent again as it was
    bad_failure: dict[int, bytes] = field(default_factory=dict)
    failures: int = 0  # failure entries folded (duplicates included)


class OutcomeFolder:
    """Entries of both outcomes folded per (step, outcome): a batch stays in step 0's acks until a
    failure of it is read; each change of a batch's outcome between ack and failure moves it to its
    next step. Failures of one batch under several reasons share a step, kept disjoint (an item
    stays with the reason it failed under first), so they apply in any order."""

    __slots__ = ("steps", "acks", "state", "extra", "claimed")

    def __init__(self) -> None:
        self.acks = EntryFolder()
        self.steps: list[dict[str | None, EntryFolder]] = [{None: self.acks}]
        # batch id as written -> (step, outcome), once a failure of the batch was read
        self.state: dict[str, tuple[int, str | None]] = {}
        self.extra = 0  # masks held beyond the first step's acks (kept by the caller of `folder`)
        # (step, group) -> the items failed in that step under any reason, once `claim` asked
        self.claimed: dict[tuple[int, tuple[int, int]], bytearray] = {}

    def folder(self, batch: str, outcome: str | None) -> EntryFolder:
        """Where the next entry of `batch` with this outcome goes (moving the batch on a change)."""
        step, current = self.state.get(batch, (0, None))
        if (current is None) != (outcome is None):
            step += 1
            if step == len(self.steps):
                self.steps.append({})
        elif outcome is None and step == 0:
            return self.acks
        if current != outcome:
            self.state[batch] = (step, outcome)
        level = self.steps[step]
        folder = level.get(outcome)
        if folder is None:
            folder = level[outcome] = EntryFolder()
        return folder

    def masks_held(self) -> int:
        return len(self.acks.masks) + self.extra

    def new_masks(self, items: list[tuple[str | None, str]]) -> int:
        """How many masks folding these (outcome, entry) pairs would add (a head that does not parse
        counts as new: it is at worst set aside)."""
        state: dict[str, tuple[int, str | None]] = {}
        seen: set[tuple[int, str | None, str]] = set()
        n = 0
        for outcome, entry in items:
            head = entry.rpartition(":")[0]
            batch = head.partition(":")[0]
            step, current = state.get(batch) or self.state.get(batch, (0, None))
            if (current is None) != (outcome is None):
                step += 1
            state[batch] = (step, outcome)
            key = (step, outcome, head)
            if key in seen:
                continue
            seen.add(key)
            folder = self.steps[step].get(outcome) if step < len(self.steps) else None
            if folder is None or _new_groups([entry], folder.masks):
                n += 1
        return n

    def disjoin(self, batch: str, outcome: str, entry: str) -> None:
        """After a failure entry (valid) was folded under `outcome`: leave out of it the items its
        step holds as failed under another reason (read first, so theirs)."""
        step = self.state[batch][0]
        level = self.steps[step]
        several = len(level) - (None in level) >= 2
        if not several and not self.claimed:
            return
        head, _, tail = entry.rpartition(":")
        folder = level[outcome]
        key = folder._heads.get(head)  # the entry was just folded: its head is known
        if key is None:
            run = parse_ack(entry)
            key = (run.batch_id, run.group_id)
        bits = folder.masks[key].bits
        start, _, end = tail.partition("-")  # checked by the fold: plain decimals
        first, last = int(start) >> 3, int(end or start) >> 3
        if several:
            for other_reason, other in level.items():
                theirs = None if other_reason is None or other_reason == outcome else other.masks.get(key)
                if theirs is not None:  # the steps' failure masks were disjoint: only the new items meet
                    their_bits = theirs.bits
                    for byte in range(first, last + 1):
                        bits[byte] &= ~their_bits[byte] & 0xFF
        claimed = self.claimed.get((step, key))
        if claimed is not None:
            for byte in range(first, last + 1):
                claimed[byte] |= bits[byte]

    def claim(self, batch: str, key: tuple[int, int]) -> bytearray:
        """The items of group `key` failed in `batch`'s step under any reason, kept up to date by
        `disjoin` and by whoever sets a bit in that step's failure masks besides it (the fast path)."""
        step = self.state[batch][0]
        claimed = self.claimed.get((step, key))
        if claimed is None:
            union = 0
            for outcome, folder in self.steps[step].items():
                mask = folder.masks.get(key) if outcome is not None else None
                if mask is not None:
                    union |= int.from_bytes(mask.bits.ljust(GROUP_BITS_BYTES, b"\0"), "big")
            claimed = self.claimed[(step, key)] = bytearray(union.to_bytes(GROUP_BITS_BYTES, "big"))
        return claimed

    def ordered(self) -> list[tuple[str | None, dict[tuple[int, int], GroupMask]]]:
        return [(outcome, f.masks) for level in self.steps for outcome, f in level.items() if f.masks]


def failure_reason(raw: bytes | None) -> str:
    """The reason a `failure-reason` header carries; raises TrackerError (InvalidValue,
    InvalidArgument) naming what is wrong, as `tracker.fail` refuses a reason."""
    if raw is None:
        raise _NoReason(f"failure entries need a {FAILURE_REASON_HEADER!r} header")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NoReason(f"the {FAILURE_REASON_HEADER!r} header is not UTF-8 ({exc.reason} at {exc.start})") from None
    return check_reason(text, FAILURE_REASON_HEADER)


class _NoReason(TrackerError, ValueError):
    pass


def _headers_of(msg: Any) -> list[tuple[str, bytes]]:
    headers = msg.headers() if callable(getattr(msg, "headers", None)) else None
    return list(headers or ())


def _reason_headers(msg: Any) -> list[bytes]:
    """The values of the message's `failure-reason` headers (an absent value read as empty)."""
    return [value or b"" for key, value in _headers_of(msg) if key == FAILURE_REASON_HEADER]


def fold_messages(messages: list[Any], *, max_groups: int = GROUPS_PER_FOLD_MAX, room: int | None = None) -> Folded:
    """Fold ack messages into masks, tolerating bad entries (kept in `.bad` with their reason).

    Bounded whatever the messages name: masks are 1 KiB a group, and a fold stops before the
    message that would take it past `room` groups (default `max_groups`; never at the first
    message, so every fold makes progress), leaving it and those after it in `.rest` for the next
    fold (fold, apply and commit, then fold the rest). A message that alone names more than
    `max_groups` groups is set aside whole as too large; one with more than BAD_ENTRIES_MAX bad
    entries is set aside whole once, its good entries folded."""
    room = max_groups if room is None else room
    out = Folded()
    outcomes = OutcomeFolder()
    folder = outcomes.acks
    out.masks = masks = folder.masks
    bad, first, last, add = out.bad, out.first, out.last, folder.add
    # Fast path, most messages: one item id (an ack) of a group already seen in this fold, whose
    # batch has no failure in it. Works on the raw bytes; anything else takes the validating path.
    by_head: dict[bytes, GroupMask] = {}
    # Likewise one failure ('!<id>') under the one reason header of a group already failed under
    # it in this fold: header value -> head -> its mask, the mask's bits and the items of the group
    # failed in the step under any reason (OutcomeFolder.claim: at most one 1 KiB union a failure
    # mask, so bounded as the masks are). Dropped whenever a batch moves between acks and failures.
    fail_head: dict[bytes, dict[bytes, tuple[GroupMask, bytearray, bytearray]]] = {}
    failures = 0
    last_raw: bytes | None = None  # the header value last looked up in `fail_head`, and its heads
    last_heads = _NO_HEADS
    index_bits = _INDEX_BITS
    count = 0
    held = 0  # masks held once the fold holds failures (before: len(masks))
    checked: dict[bytes | None, str] = {}  # failure-reason headers already read in this fold
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
            if fail_head and value[:1] == b"!":  # failures first: acks pay this only in folds with failures
                headers = msg.headers()
                hit = None
                if headers is not None and len(headers) == 1:
                    name, raw = headers[0]
                    if name == FAILURE_REASON_HEADER:
                        # A run of messages shares a reason: comparing costs less than hashing.
                        if raw != last_raw:
                            last_raw, last_heads = raw, fail_head.get(raw, _NO_HEADS)
                        hit = last_heads.get(head)
                bit = None if hit is None else index_bits.get(tail)
                if bit is not None:
                    partition = msg.partition()
                    if partition != current:
                        if previous is not None:
                            last[current] = previous.offset()
                        current = partition
                        if partition not in first:
                            first[partition] = msg.offset()
                    previous = msg
                    count += 1
                    failures += 1
                    mask, bits, claimed = hit  # type: ignore[misc]
                    byte, flag = bit[0], bit[1]
                    if not claimed[byte] & flag:  # else failed in this step already: the first reason's
                        bits[byte] |= flag
                        claimed[byte] |= flag
                    mask.count += 1
                    if bit[2] > mask.max_index:
                        mask.max_index = bit[2]
                    continue
            else:
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
        failure: str | None = None  # the message's failure reason, when it has failure entries
        raw_reason: bytes | None = None
        items: list[tuple[str | None, str]] = []
        try:
            entries = value.decode("ascii").split(",")
        except (AttributeError, UnicodeDecodeError):
            reason = "malformed: value is empty or not ASCII"
        else:
            if b"!" in value and any(e[:1] == FAIL_MARK for e in entries):
                given = _reason_headers(msg)
                raw_reason = given[0] if given else None
                failure = checked.get(raw_reason) if len(given) == 1 else None
                if failure is None:
                    try:
                        if len(given) > 1:  # which one was meant is unknown
                            raise _NoReason(f"the {FAILURE_REASON_HEADER!r} header is given {len(given)} times")
                        failure = checked[raw_reason] = failure_reason(raw_reason)
                    except TrackerError as exc:
                        reason = f"invalid failure: {exc}"
            if reason is None and (failure is not None or outcomes.state):
                items = [
                    (failure, e[1:]) if e[:1] == FAIL_MARK else (None, e) for e in entries
                ]  # (outcome, entry as an ack entry)
                held = outcomes.masks_held() if outcomes.state else len(masks)
                new = len(items)
                if new > max_groups or (held and held + new > room):
                    new = outcomes.new_masks(items)
                if new > max_groups:
                    reason = f"too large: names more than {max_groups} groups; split it"
                elif held and held + new > room:
                    out.rest = messages[position:]
                    break
            elif reason is None:
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
            if raw_reason is not None:
                out.bad_failure[len(bad)] = bytes(raw_reason)
            bad.append((msg.key(), value, reason, partition, msg.offset()))
            continue
        since, bad_here = len(bad), 0  # this message's bad entries start at bad[since]
        if failure is None and not outcomes.state:
            for entry in entries:
                reason = add(entry)
                if reason is not None:
                    bad_here += 1
                    if bad_here <= BAD_ENTRIES_MAX:
                        bad.append((msg.key(), entry.encode(), reason, partition, msg.offset()))
            if bad_here > BAD_ENTRIES_MAX:
                _set_aside_whole(out, since, bad_here, len(entries), msg, value, raw_reason)
            if len(entries) == 1 and reason is None and "-" not in entries[0]:
                parsed = parse_ack(entries[0])
                by_head[value.rpartition(b":")[0]] = masks[(parsed.batch_id, parsed.group_id)]
            continue
        # A fold holding failures: each entry goes to its batch's step for its outcome.
        for outcome, entry in items:
            batch = entry.partition(":")[0]
            if (by_head or fail_head) and (outcomes.state.get(batch, (0, None))[1] is None) != (outcome is None):
                by_head.clear()  # this batch moves between acks and failures: it leaves the fast paths' masks
                fail_head.clear()
                last_raw, last_heads = None, _NO_HEADS
            target = outcomes.folder(batch, outcome)
            before = len(target.masks)
            reason = target.add(entry)
            if target is not folder and len(target.masks) != before:
                outcomes.extra += len(target.masks) - before
            if reason is None and outcome is not None:
                outcomes.disjoin(batch, outcome, entry)
            if reason is None and outcome is None and len(items) == 1 and "-" not in entry:
                parsed = parse_ack(entry)
                by_head[value.rpartition(b":")[0]] = target.masks[(parsed.batch_id, parsed.group_id)]
            if reason is not None:
                bad_here += 1
                if bad_here > BAD_ENTRIES_MAX:
                    continue  # the message is set aside whole below
                if outcome is not None:
                    out.bad_failure[len(bad)] = bytes(raw_reason or b"")
                written = FAIL_MARK + entry if outcome is not None else entry
                bad.append((msg.key(), written.encode(), reason, partition, msg.offset()))
            elif outcome is not None:
                failures += 1
                if len(items) == 1 and "-" not in entry and raw_reason is not None:
                    head_text = entry.rpartition(":")[0]
                    key = target._heads[head_text]
                    mask = target.masks[key]
                    claimed = outcomes.claim(batch, key)
                    fail_head.setdefault(raw_reason, {})[b"!" + head_text.encode()] = (mask, mask.bits, claimed)
                    last_raw, last_heads = None, _NO_HEADS
        if bad_here > BAD_ENTRIES_MAX:
            _set_aside_whole(out, since, bad_here, len(items), msg, value, raw_reason)
    if previous is not None:
        last[current] = previous.offset()
    out.messages = count
    out.failures = failures
    out.steps = outcomes.ordered()
    return out


def _set_aside_whole(
    out: Folded, since: int, bad_here: int, entries: int, msg: Any, value: bytes, raw_reason: bytes | None
) -> None:
    """Replace the bad entries of one message, out.bad[since:], by the message itself, once, with
    how many of its entries were bad and the first one's reason (its good entries were folded:
    sent again whole, they count as duplicates)."""
    first = out.bad[since]
    del out.bad[since:]
    for n in [n for n in out.bad_failure if n >= since]:
        del out.bad_failure[n]
    if raw_reason is not None:
        out.bad_failure[since] = bytes(raw_reason)
    reason = f"{bad_here} of its {entries} entries could not be applied; the first: {first[2]}"
    out.bad.append((msg.key(), value, reason, first[3], first[4]))


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
