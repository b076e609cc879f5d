"""Item ids and folding: the bulk fold agrees with the one-entry-at-a-time fold on any input."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from tracker import (
    InvalidArgument,
    InvalidValue,
    MalformedItemId,
    expand,
    fold,
    format_item_id,
    format_run,
    parse_ack,
    parse_item_id,
)
from tracker.folding import GROUP_BITS_MAX, iter_ids
from tracker.folding.entries import _fold_each, _fold_plain_ids

plain = st.builds(
    lambda b, g, i: f"{b}:{g}:{i}", st.integers(0, 3), st.integers(0, 3), st.integers(0, GROUP_BITS_MAX - 1)
)
odd = st.sampled_from(["1:2:3-9", "1:2:0-8191", "5:0:8191", "0:0:0"])


def _as_tuples(masks):
    return {k: (bytes(m.bits).rstrip(b"\0"), m.max_index, m.count, m.batch_id, m.group_id) for k, m in masks.items()}


@given(st.lists(plain | odd, min_size=1, max_size=300), st.booleans())
@settings(max_examples=300, deadline=None)
def test_bulk_fold_agrees_with_one_at_a_time(ids, as_bytes):
    if as_bytes:
        ids = [i.encode() for i in ids]
    assert _as_tuples(fold(ids)) == _as_tuples(_fold_each(ids))


def test_bulk_path_takes_plain_ids_and_leaves_the_rest():
    assert _fold_plain_ids(["1:0:1", "1:0:2", "2:5:8191"]) is not None
    for other in (["1:0:1", "1:0:2-3"], ["1:0:1", "1:0:8192"], ["1:0:01"], ["1:0:1", b"1:0:2"], ["1:0:1:2", "3:4"]):
        assert _fold_plain_ids(other) is None, other


def test_fold_counts_duplicates_and_marks_bits_from_the_left():
    (m,) = fold(["9:1:0", "9:1:0", "9:1:9", "9:1:3-4"]).values()
    assert (m.batch_id, m.group_id, m.max_index, m.count) == (9, 1, 9, 5)
    assert m.bits[:2] == bytes([0b10011000, 0b01000000])
    assert list(iter_ids([m])) == ["9:1:0", "9:1:3", "9:1:4", "9:1:9"]


@pytest.mark.parametrize(
    "bad",
    [
        "1:2",
        "1:2:3:4",
        ":1:2",
        "1::2",
        "1:2:",
        "a:1:2",
        "1:2:x",
        "1:2:-3",
        "1:2:5-3",
        "1:2:\u0663",
        "1:2: 3",
        "1:2:+3",
        "1:2:3_0",
        "",
        b"\xff:1:2",
        12,
    ],
)
def test_malformed_ids_are_named(bad):
    with pytest.raises(MalformedItemId) as exc:
        fold(["1:0:0", bad])
    assert repr(bad) in str(exc.value)


def test_parse_and_format_round_trip():
    assert parse_item_id("12:3:45") == (12, 3, 45) and str(parse_item_id(b"12:3:45")) == "12:3:45"
    assert parse_ack("12:3:4-9") == (12, 3, 4, 9) and format_run(12, 3, 4, 9) == "12:3:4-9"
    assert format_run(12, 3, 4, 4) == "12:3:4"


@pytest.mark.parametrize("bad", ["9223372036854775808:0:0", "1:9223372036854775808:0", "1:" + "9" * 5000 + ":1"])
def test_ids_past_a_bigint_are_malformed_on_every_path(bad):
    # Not a database overflow later, and never a huge integer conversion.
    for call in (lambda: parse_ack(bad), lambda: fold([bad]), lambda: fold(["1:0:1", bad])):
        with pytest.raises(MalformedItemId, match="is larger than 9223372036854775807"):
            call()


@pytest.mark.parametrize("bad", ["1:0:8192", "1:0:99999999999999", "1:0:0-99999999999999", "1:0:3-8192"])
def test_an_index_no_group_can_hold_is_out_of_range_before_any_allocation(bad):
    from tracker import IndexOutOfRange

    for call in (lambda: parse_ack(bad), lambda: fold([bad]), lambda: fold(["1:0:1", bad])):
        with pytest.raises(IndexOutOfRange, match="no group holds more than 8192 items"):
            call()
    assert parse_ack("9223372036854775807:9223372036854775807:8191") == (2**63 - 1, 2**63 - 1, 8191, 8191)
    with pytest.raises(MalformedItemId, match="leading zero"):  # not index 7 spelled long
        parse_ack("1:0:" + "0" * 5000 + "7")


@pytest.mark.parametrize("spelled", ["007:2:5", "1:02:5", "1:2:0005", "1:2:05-9", "1:2:5-09", "00:0:0", b"01:0:0"])
def test_a_number_with_a_leading_zero_is_malformed_not_another_spelling(spelled):
    """'07' and '7' would be two spellings of one id: ids are read one way only."""
    with pytest.raises(MalformedItemId, match="leading zero"):
        parse_ack(spelled)
    with pytest.raises(MalformedItemId):
        fold(["1:2:3", spelled])


# ---------------------------------------------------------------- writing ids: checked as read

ID_MAX = (1 << 63) - 1
WHOLE = st.integers(0, ID_MAX)
INDEX = st.integers(0, GROUP_BITS_MAX - 1)


@given(WHOLE, WHOLE, INDEX, INDEX)
@settings(max_examples=200, deadline=None)
def test_every_id_written_is_read_back_the_same(batch_id, group_id, a, b):
    start, end = min(a, b), max(a, b)
    assert parse_item_id(format_item_id(batch_id, group_id, a)) == (batch_id, group_id, a)
    assert parse_ack(format_run(batch_id, group_id, start, end)) == (batch_id, group_id, start, end)


NOT_WHOLE = st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.none(), st.just([1]))


@given(st.sampled_from(["batch_id", "group_id", "index"]), NOT_WHOLE)
@settings(max_examples=100, deadline=None)
def test_a_part_of_the_wrong_type_is_named(part, value):
    args = {"batch_id": 1, "group_id": 2, "index": 3, part: value}
    with pytest.raises(InvalidArgument) as info:
        format_item_id(**args)
    assert part in str(info.value) and repr(value)[:100] in str(info.value)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: format_item_id(-1, 0, 0), "batch_id"),
        (lambda: format_item_id(ID_MAX + 1, 0, 0), "batch_id"),
        (lambda: format_item_id(1, -1, 0), "group_id"),
        (lambda: format_item_id(1, 1, GROUP_BITS_MAX), "index"),
        (lambda: format_run(1, 1, 5, 4), "end"),
        (lambda: format_run(1, 1, 0, GROUP_BITS_MAX), "end"),
        (lambda: expand(1, 1, -5), "upto"),
        (lambda: expand(1, 1, GROUP_BITS_MAX + 1), "upto"),
        (lambda: expand(-1, 1, 2), "batch_id"),
    ],
)
def test_a_part_out_of_range_is_refused_by_name(call, name):
    with pytest.raises(InvalidValue) as info:
        call()
    assert str(info.value).startswith(name + " ")


def test_expand_refuses_a_huge_count_before_building_anything():
    # 10**9 strings would take tens of GiB; a number past Python's digit limit cannot even be shown
    for upto in (10**9, 10**5000):
        with pytest.raises(InvalidValue) as info:
            expand(1, 1, upto)
        assert "upto" in str(info.value)
    assert "an int of 16,610 bits" in str(info.value)
    assert expand(3, 4, 0) == [] and expand(3, 4, 2) == ["3:4:0", "3:4:1"]
    assert len(expand(3, 4, GROUP_BITS_MAX)) == GROUP_BITS_MAX
