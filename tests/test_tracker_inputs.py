"""Bad input, over the input space: a typed error (a TrackerError) that names the value as the caller
wrote it, raised before any allocation in proportion to it, and nothing written: the caller's
transaction is usable and exactly as it was. Property tests against the real Postgres."""

from __future__ import annotations

import re

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tracker_support import snapshot

import tracker
from tracker.core.validate import MAX_ITEMS_PER_CALL
from tracker.ids import GROUP_BITS_MAX

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def world(conn, schema):
    """A committed open batch of 20 items in one group and a closed one; the caller's transaction
    then has a row of its own in it."""
    t = tracker.Tracker(schema=schema)
    batch = t.open_batch(conn)
    t.add_items(conn, batch, 20)
    closed = t.open_batch(conn)
    t.add_items(conn, closed, 5)
    t.close_batch(conn, closed)
    conn.execute("CREATE TABLE caller_rows (tag text)")
    conn.commit()
    conn.execute("INSERT INTO caller_rows VALUES ('mine')")
    return t, batch, closed


def refused(conn, schema, call, error, *shown: str) -> tracker.TrackerError:
    """`call` raises `error` naming every string in `shown`, and changes nothing."""
    before = snapshot(conn, schema)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, tracker.TrackerError), type(info.value)
    for text in shown:
        assert text in str(info.value), (text, str(info.value))
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert conn.execute("SELECT tag FROM caller_rows").fetchall() == [("mine",)]  # usable, as it was
    assert snapshot(conn, schema) == before
    return info.value


# ---------------------------------------------------------------- whole arguments of the wrong type

NOT_IDS = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.dictionaries(st.text(), st.text()),
    st.builds(bytearray, st.binary()),
)
NOT_COUNTS = st.one_of(st.none(), st.text(), st.floats(), st.booleans(), st.lists(st.integers(), max_size=3))
NOT_BATCHES = st.one_of(
    st.text(), st.floats(), st.none(), st.booleans(), st.integers(max_value=-1), st.integers(min_value=2**63)
)


@SETTINGS
@given(value=NOT_IDS)
def test_ids_argument_of_the_wrong_type(conn, schema, world, value):
    t, _, _ = world
    refused(conn, schema, lambda: t.ack(conn, value), tracker.InvalidArgument, "item_ids", type(value).__name__)


@SETTINGS
@given(value=NOT_COUNTS)
def test_count_of_the_wrong_type(conn, schema, world, value):
    t, batch, _ = world
    refused(conn, schema, lambda: t.add_items(conn, batch, value), tracker.InvalidArgument, "n", repr(value)[:100])


@SETTINGS
@given(value=NOT_BATCHES)
def test_batch_of_the_wrong_type(conn, schema, world, value):
    t, _, _ = world
    refused(conn, schema, lambda: t.add_items(conn, value, 1), tracker.InvalidArgument, "batch", repr(value)[:100])
    refused(conn, schema, lambda: t.close_batch(conn, value), tracker.InvalidArgument, "batch")


@SETTINGS
@given(
    bad_id=st.one_of(st.text(max_size=10), st.integers().filter(lambda n: not 0 <= n < 2**63), st.none(), st.booleans())
)
def test_a_hand_built_batch_with_a_bad_id_is_refused_naming_it(conn, schema, world, bad_id):
    # Batch is a plain dataclass: Batch("x") reached the database as a raw InvalidTextRepresentation
    t, _, _ = world
    built = tracker.Batch(bad_id, None, None, None)
    for call in (
        lambda: t.status(conn, built),
        lambda: t.add_items(conn, built, 1),
        lambda: t.close_batch(conn, built),
        lambda: t.failures(conn, built),
        lambda: t.open_batch(conn, parent=built),
    ):
        refused(conn, schema, call, tracker.InvalidArgument, f"id={bad_id!r}"[:40])


@pytest.mark.parametrize("items", [None, 7, "abc", b"abc", {"a": 1}])
def test_items_argument_of_the_wrong_type(conn, schema, world, items):
    t, batch, _ = world
    refused(conn, schema, lambda: t.enqueue(conn, batch, items, topic="w"), tracker.InvalidArgument, "items")


def test_a_connection_the_tracker_cannot_run_in(conn, schema, world):
    t, batch, _ = world
    for session in (None, "postgresql://", object()):
        with pytest.raises(tracker.UnsupportedConnection, match="psycopg 3 Connection"):
            t.status(session, batch)


# ---------------------------------------------------------------- counts past what a call may add


@SETTINGS
@given(n=st.one_of(st.integers(min_value=MAX_ITEMS_PER_CALL + 1), st.integers(max_value=-1)))
def test_counts_out_of_bounds_are_refused_before_allocating(conn, schema, world, n):
    t, batch, _ = world
    # checked before anything is built: 2**63 used to end in MemoryError
    refused(conn, schema, lambda: t.add_items(conn, batch, n), tracker.InvalidValue, repr(n)[:150])


# ---------------------------------------------------------------- ids with separators, whitespace, NUL

BAD_CHARS = st.sampled_from([",", "\n", "\r", " ", "\t", "\x00", ";", "\u00a0", "\u0663", "+", "x", "\ufeff", ":"])


@SETTINGS
@given(
    group=st.integers(0, 0),
    index=st.integers(0, 19),
    bad=BAD_CHARS,
    where=st.integers(0, 100),
    others=st.integers(0, 3),
)
def test_ids_with_a_foreign_character_inside(conn, schema, world, group, index, bad, where, others):
    t, batch, _ = world
    good = f"{batch.id}:{group}:{index}"
    pos = where % (len(good) + 1)
    entry = good[:pos] + bad + good[pos:]
    ids = [f"{batch.id}:0:{i}" for i in range(others)] + [entry]
    try:
        parsed = tracker.parse_ack(entry)
    except tracker.TrackerError:
        parsed = None
    if parsed is not None:  # a harmless spelling (e.g. "+" never is; ':' at an end never is)
        pytest.fail(f"{entry!r} parsed as {parsed}")
    err = refused(
        conn,
        schema,
        lambda: t.ack(conn, ids),
        (tracker.MalformedItemId, tracker.IndexOutOfRange),
        repr(entry) if isinstance(entry, str) else entry,
    )
    assert getattr(err, "item_id", None) == entry


def test_an_id_with_a_newline_is_not_two_ids(conn, schema, world):
    t, batch, _ = world
    entry = f"{batch.id}:0:1\n{batch.id}:0:2"
    refused(conn, schema, lambda: t.ack(conn, [f"{batch.id}:0:3", entry]), tracker.MalformedItemId, repr(entry))
    refused(conn, schema, lambda: t.ack(conn, entry.encode()), tracker.MalformedItemId)


# ---------------------------------------------------------------- runs past a group's end


@SETTINGS
@given(start=st.integers(0, 19), past=st.integers(20, GROUP_BITS_MAX - 1), bytes_form=st.booleans())
def test_a_run_past_the_groups_end_is_named_as_written(conn, schema, world, start, past, bytes_form):
    t, batch, _ = world
    run = f"{batch.id}:0:{start}-{past}"
    entry = run.encode() if bytes_form else run
    err = refused(conn, schema, lambda: t.ack(conn, [f"{batch.id}:0:0", entry]), tracker.IndexOutOfRange, repr(run))
    assert err.item_id == run and err.size == 20


@SETTINGS
@given(index=st.integers(GROUP_BITS_MAX, 10**30))
def test_an_index_no_group_can_hold(conn, schema, world, index):
    t, batch, _ = world
    entry = f"{batch.id}:0:0-{index}"
    refused(
        conn, schema, lambda: t.ack(conn, [entry]), (tracker.IndexOutOfRange, tracker.MalformedItemId), repr(entry)[:60]
    )


# ---------------------------------------------------------------- headers, topics and keys

NOT_HEADER_VALUES = st.one_of(
    st.integers(),
    st.floats(allow_nan=False),
    st.none(),
    st.lists(st.binary(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
)


@SETTINGS
@given(value=NOT_HEADER_VALUES, per_item=st.booleans())
def test_header_values_of_unsupported_types(conn, schema, world, value, per_item):
    t, batch, _ = world
    if per_item:
        call = lambda: t.enqueue(conn, batch, [b"a", tracker.Message(b"b", headers={"h": value})], topic="w")  # noqa: E731
    else:
        call = lambda: t.enqueue(conn, batch, [b"a"], topic="w", headers={"h": value})  # noqa: E731
    refused(conn, schema, call, tracker.InvalidArgument, "header 'h' value", type(value).__name__)


@SETTINGS
@given(name=st.one_of(st.integers(), st.none(), st.just(""), st.binary(min_size=1)))
def test_header_names_of_unsupported_types(conn, schema, world, name):
    t, batch, _ = world
    refused(
        conn,
        schema,
        lambda: t.enqueue(conn, batch, [b"a"], topic="w", headers=[(name, b"v")]),
        tracker.InvalidArgument,
        "header name",
        repr(name),
    )


BAD_TEXT = st.one_of(
    st.tuples(st.text(max_size=5), st.text(max_size=5)).map(lambda p: p[0] + "\x00" + p[1]),
    st.tuples(st.text(max_size=5), st.sampled_from(["\ud800", "\udcff", "\udfff"])).map(lambda p: p[0] + p[1]),
)


@SETTINGS
@given(text=BAD_TEXT)
def test_nul_or_invalid_utf8_in_topics_user_keys_and_header_names(conn, schema, world, text):
    t, batch, _ = world
    refused(conn, schema, lambda: t.enqueue(conn, batch, [b"a"], topic=text), tracker.InvalidValue, "topic", repr(text))
    refused(conn, schema, lambda: t.open_batch(conn, user_key=text), tracker.InvalidValue, "user_key", repr(text))
    refused(conn, schema, lambda: t.open_batch(conn, completion_topic=text), tracker.InvalidValue, "completion_topic")
    if text:  # a header name is text too
        refused(
            conn,
            schema,
            lambda: t.enqueue(conn, batch, [b"a"], topic="w", headers={text: b"v"}),
            tracker.InvalidValue,
            repr(text),
        )


@SETTINGS
@given(prefix=st.text(max_size=5), bad=st.sampled_from(["\ud800", "\udcff"]))
def test_invalid_utf8_in_keys_values_and_header_values(conn, schema, world, prefix, bad):
    t, batch, _ = world
    text = prefix + bad
    refused(conn, schema, lambda: t.enqueue(conn, batch, [b"a"], topic="w", key=text), tracker.InvalidValue, "key")
    refused(conn, schema, lambda: t.enqueue(conn, batch, [b"a", text], topic="w"), tracker.InvalidValue, "item value")
    refused(
        conn,
        schema,
        lambda: t.enqueue(conn, batch, [b"a"], topic="w", headers={"h": text}),
        tracker.InvalidValue,
        "header 'h' value",
    )


def test_a_nul_in_a_key_is_bytes_and_round_trips(conn, schema, world):
    t, batch, _ = world
    t.enqueue(conn, batch, [b"a"], topic="w", key="k\x00ey")
    assert conn.execute("SELECT key FROM outbox WHERE topic = 'w'").fetchall() == [(b"k\x00ey",)]


def test_values_that_are_not_json_serialisable(conn, schema, world):
    t, batch, _ = world
    refused(conn, schema, lambda: t.enqueue(conn, batch, [b"a", object()], topic="w"), tracker.InvalidValue, "item")
    refused(conn, schema, lambda: t.enqueue(conn, batch, [{"x": float("nan")}], topic="w"), tracker.InvalidValue)


@pytest.mark.parametrize("empty", [[], (), iter(()), set()])
def test_nothing_to_ack_is_a_no_op(conn, schema, world, empty):
    """An empty list of ids (or masks) sends nothing and returns an empty result, sync and async."""
    import asyncio

    t, _, _ = world
    before = snapshot(conn, schema)
    r = t.ack(conn, empty)
    assert (r.acked, r.duplicates, r.completed) == (0, 0, [])
    assert t.apply_masks(conn, {}).acked == 0
    assert snapshot(conn, schema) == before

    async def async_side() -> None:
        async with await psycopg.AsyncConnection.connect(conn.info.dsn) as aconn:
            r = await tracker.AsyncTracker(schema=schema).ack(aconn, [])
            assert (r.acked, r.duplicates, r.completed) == (0, 0, [])

    asyncio.run(async_side())


# ---------------------------------------------------------------- names Kafka refuses, keys no index holds

KAFKA_NAMES = st.from_regex(r"[A-Za-z0-9._-]{1,249}", fullmatch=True).filter(lambda n: n not in (".", ".."))
SHORT_NAMES = st.from_regex(r"[A-Za-z0-9._-]{0,100}", fullmatch=True)
NOT_KAFKA_NAMES = st.one_of(
    st.sampled_from([".", "..", "a b", "topic/x", "é", "t" * 250, "a:b"]),
    # a legal name with one character Kafka refuses somewhere in it
    st.tuples(
        SHORT_NAMES,
        st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]).filter(
            lambda c: re.fullmatch(r"[A-Za-z0-9._-]", c) is None
        ),
        SHORT_NAMES,
    ).map("".join),
)


@SETTINGS
@given(topic=NOT_KAFKA_NAMES)
def test_a_topic_name_kafka_refuses_is_refused_at_the_call(conn, schema, world, topic):
    t, batch, _ = world
    refused(
        conn,
        schema,
        lambda: t.enqueue(conn, batch, [b"a"], topic=topic),
        tracker.InvalidValue,
        "topic",
        repr(topic)[:100],
    )
    refused(conn, schema, lambda: t.open_batch(conn, completion_topic=topic), tracker.InvalidValue, "completion_topic")


@SETTINGS
@given(topic=KAFKA_NAMES)
def test_every_name_kafka_accepts_is_accepted(conn, schema, world, topic):
    t, batch, _ = world
    conn.execute("SAVEPOINT names")
    t.enqueue(conn, batch, [b"a"], topic=topic)
    assert t.open_batch(conn, completion_topic=topic).completion_topic == topic
    conn.execute("ROLLBACK TO SAVEPOINT names")


@pytest.mark.parametrize(
    "key, shown",
    [("k" * 1001, "1000 characters (1001)"), ("\U0001d11e" * 501, "2000 bytes in UTF-8 (2004)")],
)
def test_a_user_key_no_index_entry_holds_is_refused(conn, schema, world, key, shown):
    t, _, _ = world
    refused(conn, schema, lambda: t.open_batch(conn, user_key=key), tracker.InvalidValue, "user_key", shown)


@pytest.mark.parametrize("key", ["k" * 1000, "\U0001d11e" * 500, "é" * 1000])
def test_a_user_key_at_the_caps_is_stored_as_given(conn, schema, world, key):
    t, _, _ = world
    batch = t.open_batch(conn, user_key=key)
    assert t.status(conn, batch).user_key == key


# ---------------------------------------------------------------- settle's arguments


@pytest.mark.parametrize(
    "kwargs, error, shown",
    [
        ({"batch_ids": 5}, tracker.InvalidArgument, "5"),
        ({"batch_ids": "12"}, tracker.InvalidArgument, "'12'"),
        ({"batch_ids": [1, "x"]}, tracker.InvalidArgument, "'x'"),
        ({"batch_ids": [1, True]}, tracker.InvalidArgument, "True"),
        ({"batch_ids": [2**63]}, tracker.InvalidValue, str(2**63)),
        ({"batch_ids": [-1]}, tracker.InvalidValue, "-1"),
        ({"limit": 2**63}, tracker.InvalidValue, str(2**63)),
        ({"limit": 0}, tracker.InvalidValue, "0"),
        ({"limit": 1.5}, tracker.InvalidArgument, "1.5"),
    ],
)
def test_settle_names_a_bad_argument_and_changes_nothing(conn, schema, world, kwargs, error, shown):
    refused(conn, schema, lambda: tracker.settle(conn, schema=schema, **kwargs), error, shown)
