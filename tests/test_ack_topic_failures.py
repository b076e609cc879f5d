"""Failures through the ack topic, without services: the message grammar AckProducer writes and the
acker's fold reads (entries written after '!', the reason in the `failure-reason` header), the order
the fold keeps per batch, and what it refuses.

AckProducer's Kafka producer is swapped for a recorder of what it would produce: these tests are
about the bytes of the format; tests/test_ack_topic_failures_reaper.py sends them through Kafka to
a real `reaper run`."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import Msg

from harvester.services.ack_steps import relevel
from tracker.consumer import AckProducer
from tracker.errors import InvalidArgument, InvalidValue, MalformedItemId
from tracker.folding import FAILURE_REASON_HEADER, failure_reason, fold_messages


class Recorder:
    """Stands in for confluent_kafka.Producer inside AckProducer: keeps what would be produced."""

    def __init__(self):
        self.sent: list[Msg] = []

    def produce(self, topic, key=None, value=None, headers=None, on_delivery=None):
        self.sent.append(Msg(value, len(self.sent), headers, key))

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0


def recording_producer(**kw) -> tuple[AckProducer, Recorder]:
    p = AckProducer(bootstrap_servers="127.0.0.1:1", topic="acks", kafka_client={"log_level": 0}, **kw)
    rec = Recorder()
    p._producer = rec  # type: ignore[assignment]
    return p, rec


def items_of(masks) -> set[tuple[int, int, int]]:
    return {(b, g, i) for (b, g), m in masks.items() for i in m.indexes()}


def apply_in_order(steps) -> dict[tuple[int, int, int], str | None]:
    """A model of applying steps one after the other: the first outcome of an item wins."""
    decided: dict[tuple[int, int, int], str | None] = {}
    for reason, masks in steps:
        for item in sorted(items_of(masks)):
            decided.setdefault(item, reason)
    return decided


def per_batch_runs(seq) -> dict[int, list[tuple[bool, dict]]]:
    """Per batch, in order, its runs of acks and of failures: (failed, item -> its outcome in the
    run), each item keeping the first outcome the run gives it (the reason a failure run fails it
    under first)."""
    out: dict[int, list[tuple[bool, dict]]] = {}
    for outcome, items in seq:
        for item in sorted(items):
            runs = out.setdefault(item[0], [])
            if not runs or runs[-1][0] != (outcome is not None):
                runs.append((outcome is not None, {}))
            runs[-1][1].setdefault(item, outcome)
    return out


reasons = st.one_of(
    st.sampled_from(["timeout", "bad row, skipped", "!1:0:0", "price ✓ ü", "a" * 500, "x:y,z"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=20),
)
ids = st.tuples(st.integers(1, 3), st.integers(0, 1), st.integers(0, 40), st.integers(0, 3))
calls = st.lists(st.tuples(st.one_of(st.none(), reasons), st.lists(ids, min_size=1, max_size=6)), max_size=25)


def as_entries(picked) -> list[str]:
    return [f"{b}:{g}:{i}" if n == 0 else f"{b}:{g}:{i}-{i + n}" for b, g, i, n in picked]


@settings(max_examples=200, deadline=None)
@given(calls, st.booleans())
def test_producer_to_fold_round_trip_keeps_the_first_outcome_of_every_item(seq, flush_each):
    """Whatever a consumer acks and fails through AckProducer, in whatever order and however it
    flushes, the acker's fold decides every item as the calls did: its first outcome."""
    # small messages: several per batch; no linger, so only flush() sends (a slow machine would
    # otherwise pass the 50 ms linger mid-sequence and send an item again, counted twice)
    p, rec = recording_producer(max_message_bytes=64, linger=3600.0)
    expected: dict[tuple[int, int, int], str | None] = {}
    for reason, picked in seq:
        entries = as_entries(picked)
        if reason is None:
            p.ack(entries)
        else:
            p.fail(entries, reason)
        for b, g, i, n in picked:
            for k in range(i, i + n + 1):
                expected.setdefault((b, g, k), reason)
        if flush_each:
            p.flush()
    p.flush()
    for m in rec.sent:  # one outcome per message; failures carry their reason, acks no header
        entries = m.value().decode().split(",")
        if m.headers() is None:
            assert not any(e.startswith("!") for e in entries)
        else:
            assert all(e.startswith("!") for e in entries)
            ((name, raw),) = m.headers()
            assert name == FAILURE_REASON_HEADER and failure_reason(raw) == raw.decode()
        assert m.key() == entries[0].lstrip("!").split(":")[0].encode()
    folded = fold_messages(rec.sent)
    assert folded.bad == [] and folded.rest == []
    assert apply_in_order(folded.steps) == expected
    if not flush_each:  # nothing decided twice leaves the producer's buffer
        assert p.acks_sent + p.failures_sent == len(expected)


entry_kinds = st.tuples(st.integers(1, 3), st.integers(0, 2), st.integers(0, 30), st.integers(0, 2), st.booleans())
messages = st.lists(
    st.tuples(st.lists(entry_kinds, min_size=1, max_size=4), st.one_of(st.none(), reasons)), max_size=30
)


def build(msgs):
    """Messages of hand-written entries: a '!' entry fails under the message's reason (when the
    message has one), and the model of what each message names, in order."""
    built, seq = [], []
    for n, (entries, reason) in enumerate(msgs):
        written = []
        for b, g, i, span, failed in entries:
            text = f"{b}:{g}:{i}" if span == 0 else f"{b}:{g}:{i}-{i + span}"
            failed = failed and reason is not None
            written.append(("!" if failed else "") + text)
            seq.append((reason if failed else None, {(b, g, k) for k in range(i, i + span + 1)}))
        headers = None if reason is None else [(FAILURE_REASON_HEADER, reason.encode())]
        built.append(Msg(",".join(written).encode(), n, headers))
    return built, seq


@settings(max_examples=300, deadline=None)
@given(messages, st.integers(1, 12))
def test_the_fold_keeps_each_batchs_order_of_outcomes_whatever_the_round_bound(msgs, room):
    """Mixed messages, folded in rounds of at most `room` masks (the acker's bound): per batch, the
    steps name the same items in the same runs of acks and of failures as the messages, each item
    of a failure run with the reason it failed under first, so applying the steps one by one records
    what applying the messages one by one would. Re-levelled (the acker merging deferred steps into
    a poll's) the order holds too; acks alone stay one statement."""
    built, seq = build(msgs)
    steps = []
    rest = built
    while rest:
        folded = fold_messages(rest, max_groups=12, room=room)
        assert folded.bad == []
        held = sum(len(m) for _r, m in folded.steps)
        assert held <= room or folded.messages == 1  # only a round's first message may go past it
        steps.extend(folded.steps)
        rest = folded.rest
    want = per_batch_runs(seq)
    assert per_batch_runs([(r, items_of(m)) for r, m in steps]) == want
    relevelled = relevel(steps)
    assert per_batch_runs([(r, items_of(m)) for r, m in relevelled]) == want
    acks_only = [(None, m) for r, m in steps if r is None]
    assert len(relevel(acks_only)) == min(1, len(acks_only))


def test_acks_only_fold_into_one_step_as_before():
    f = fold_messages([Msg(b"1:0:0", 0), Msg(b"1:0:1", 1), Msg(b"2:0:0-5,1:1:3", 2)])
    assert [(r, sorted(m)) for r, m in f.steps] == [(None, [(1, 0), (1, 1), (2, 0)])]
    assert f.steps[0][1] is f.masks


def test_a_failure_between_acks_splits_its_batch_only():
    reason = [(FAILURE_REASON_HEADER, b"boom")]
    f = fold_messages(
        [
            Msg(b"1:0:0", 0),
            Msg(b"2:0:0", 1),
            Msg(b"!1:0:1-2", 2, reason),
            Msg(b"1:0:3", 3),
            Msg(b"2:0:1", 4),  # batch 2 never failed: it stays in the first step
        ]
    )
    assert [(r, sorted(items_of(m))) for r, m in f.steps] == [
        (None, [(1, 0, 0), (2, 0, 0), (2, 0, 1)]),
        ("boom", [(1, 0, 1), (1, 0, 2)]),
        (None, [(1, 0, 3)]),
    ]
    assert f.failures == 1


@pytest.mark.parametrize(
    "headers, why",
    [
        (None, "failure entries need a 'failure-reason' header"),
        ([(FAILURE_REASON_HEADER, b"")], "must be a non-empty string"),
        ([(FAILURE_REASON_HEADER, b"x" * 501)], "is longer than 500 characters (501)"),
        ([(FAILURE_REASON_HEADER, "é".encode() * 500)], None),  # 500 characters, 1000 bytes: fine
        ([(FAILURE_REASON_HEADER, b"a\x00b")], "contains a NUL character"),
        ([(FAILURE_REASON_HEADER, b"\xff\xfe")], "is not UTF-8"),
        ([(FAILURE_REASON_HEADER, b"a"), (FAILURE_REASON_HEADER, b"b")], "header is given 2 times"),
    ],
)
def test_an_invalid_failure_message_is_set_aside_whole_with_its_reason(headers, why):
    f = fold_messages([Msg(b"1:0:0,!1:0:1", 7, headers)])
    if why is None:
        assert f.bad == [] and [r for r, _m in f.steps] == [None, "é" * 500]
        return
    ((key, value, reason, partition, offset),) = f.bad
    assert (key, value, partition, offset) == (b"1", b"1:0:0,!1:0:1", 0, 7)
    assert reason.startswith("invalid failure: ") and why in reason, reason
    # the dead letter keeps the (first) header as received
    assert f.steps == [] and f.bad_failure.get(0) == (None if headers is None else headers[0][1])


def test_messages_the_ack_format_accepts_keep_their_meaning():
    """A '!' only marks an entry that starts with it; elsewhere an entry is malformed as before,
    and headers of an ack message change nothing."""
    f = fold_messages(
        [
            Msg(b"1:0:0,1:0:!5", 0),
            Msg(b"1:0:1", 1, [(FAILURE_REASON_HEADER, b"ignored: no failure entry")]),
        ]
    )
    assert [(r, sorted(items_of(m))) for r, m in f.steps] == [(None, [(1, 0, 0), (1, 0, 1)])]
    assert [(e, r.split(":")[0]) for _k, e, r, _p, _o in f.bad] == [(b"1:0:!5", "malformed")]


def test_bad_failure_entries_are_set_aside_as_written_with_their_reason_header():
    f = fold_messages([Msg(b"!1:0:x,!1:0:8192,!!1:0:1,!1:0:2", 3, [(FAILURE_REASON_HEADER, b"why")])])
    assert [(e, r.split(":")[0]) for _k, e, r, _p, _o in f.bad] == [
        (b"!1:0:x", "malformed"),
        (b"!1:0:8192", "index out of range"),
        (b"!!1:0:1", "malformed"),
    ]
    assert f.bad_failure == {0: b"why", 1: b"why", 2: b"why"}
    assert [(r, sorted(items_of(m))) for r, m in f.steps] == [("why", [(1, 0, 2)])]


def test_a_message_that_alone_needs_more_masks_than_a_round_holds_is_too_large():
    # alternating outcomes of one group: a mask per change, each 1 KiB, counted before any exists
    value = ",".join(f"1:0:{i}" if i % 2 else f"!1:0:{i}" for i in range(10)).encode()
    f = fold_messages([Msg(value, 0, [(FAILURE_REASON_HEADER, b"r")])], max_groups=9)
    ((_k, _v, reason, _p, _o),) = f.bad
    assert reason.startswith("too large") and f.steps == []
    f = fold_messages([Msg(value, 0, [(FAILURE_REASON_HEADER, b"r")])], max_groups=10)
    assert f.bad == [] and len(f.steps) == 10


@pytest.mark.parametrize(
    "reason, error",
    [
        ("", InvalidValue),
        ("x" * 501, InvalidValue),
        ("a\x00", InvalidValue),
        ("\ud800", InvalidValue),
        (None, InvalidArgument),
        (b"bytes", InvalidArgument),
    ],
)
def test_producer_fail_refuses_a_reason_as_tracker_fail_does_and_buffers_nothing(reason, error):
    p, rec = recording_producer()
    with pytest.raises(error) as got:
        p.fail(["1:0:0"], reason)
    assert got.value.name == "reason"
    with pytest.raises(MalformedItemId):
        p.fail(["1:0:1", "1:0:07"], "fine")
    p.flush()
    assert rec.sent == [] and p.failures_sent == 0


def test_producer_sends_a_failure_after_a_buffered_ack_of_the_item_as_nothing():
    p, rec = recording_producer()
    p.ack(["5:0:0-3"])
    p.fail(["5:0:2-5"], "late")  # 2 and 3 were acked first: only 4 and 5 fail
    p.ack(["5:0:5-6"])  # 5 failed first: only 6 is acked
    p.flush()
    sent = sorted((m.value(), m.headers()) for m in rec.sent)
    assert sent == [(b"!5:0:4-5", [(FAILURE_REASON_HEADER, b"late")]), (b"5:0:0-3,5:0:6", None)]
    assert (p.acks_sent, p.failures_sent) == (5, 2)


single = st.tuples(
    st.integers(1, 2), st.integers(0, 1), st.integers(0, 12), st.sampled_from([None, "r1", "r2", "r3"]), st.booleans()
)


@settings(max_examples=400, deadline=None)
@given(st.lists(single, max_size=60))
def test_single_id_messages_under_few_reasons_keep_the_first_outcome_of_every_item(picked):
    """The fold's fast paths (one id a message: acks, and failures under a reason already seen for
    the group in the fold), mixed with messages of two entries that take the validating path: the
    steps decide every item as applying the messages one by one would (its first outcome)."""
    msgs, expected = [], {}
    for n, (b, g, i, reason, pair) in enumerate(picked):
        written = [f"{b}:{g}:{i}"] + ([f"{b}:{g}:{i + 1}"] if pair else [])
        mark = "" if reason is None else "!"
        headers = None if reason is None else [(FAILURE_REASON_HEADER, reason.encode())]
        msgs.append(Msg(",".join(mark + w for w in written).encode(), n, headers))
        for k in range(i, i + 1 + pair):
            expected.setdefault((b, g, k), reason)
    folded = fold_messages(msgs)
    assert folded.bad == [] and folded.rest == []
    assert apply_in_order(folded.steps) == expected
    assert folded.failures == sum(1 + p for _b, _g, _i, r, p in picked if r is not None)


def test_relevel_merges_deferred_steps_into_the_fewest_statements():
    """A batch deferred with its failures, then a poll acking and failing another: two statements
    (the new batch's acks, then both batches' failures), not three; each batch's order kept."""
    a, b = (
        fold_messages([Msg(b"!1:0:0", 0, [(FAILURE_REASON_HEADER, b"r")])]),
        fold_messages([Msg(b"2:0:0", 0), Msg(b"!2:0:1", 1, [(FAILURE_REASON_HEADER, b"r")])]),
    )
    got = relevel(a.steps + b.steps)
    assert [(r, sorted(m)) for r, m in got] == [(None, [(2, 0)]), ("r", [(1, 0), (2, 0)])]
    # and a batch joining the levels of others, a failure under a new reason among theirs
    c = fold_messages(
        [
            Msg(b"3:0:0", 0),
            Msg(b"!3:0:1", 1, [(FAILURE_REASON_HEADER, b"r")]),
            Msg(b"3:0:2", 2),
            Msg(b"4:0:0", 3),
            Msg(b"!4:0:1", 4, [(FAILURE_REASON_HEADER, b"s")]),
            Msg(b"4:0:2", 5),
        ]
    )
    assert [r for r, _m in relevel(c.steps)] == [None, "r", "s", None]


@settings(max_examples=200, deadline=None)
@given(messages, messages)
def test_relevel_never_adds_statements(first, second):
    """Deferred steps and a poll's, re-levelled: never more statements than they were, and per
    batch the same runs of outcomes."""
    steps = fold_messages(build(first)[0]).steps + fold_messages(build(second)[0]).steps
    got = relevel(steps)
    assert len(got) <= len(steps)
    assert per_batch_runs([(r, items_of(m)) for r, m in got]) == per_batch_runs([(r, items_of(m)) for r, m in steps])
