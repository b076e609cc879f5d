"""tracker.folding without Kafka: ack messages folded into masks per group, bad entries set aside
with their reason (the fold the acker, AckProducer and the Spark path share)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import Msg

from tracker.folding import EntryFolder, fold_messages

# single ids of a few groups, written as a client might: canonical, with leading zeros, too large
_tails = st.one_of(
    st.integers(0, 8191).map(str),
    st.integers(0, 99).map(lambda i: f"0{i}"),
    st.sampled_from(["8192", "99999", "1٣", "", "-1"]),
)
_single_ids = st.tuples(st.integers(1, 3), st.integers(0, 2), _tails).map(lambda t: f"{t[0]}:{t[1]}:{t[2]}")


@settings(max_examples=300, deadline=None)
@given(st.lists(_single_ids, max_size=60))
def test_the_single_id_fast_path_folds_as_the_validating_path_does(ids):
    f = fold_messages([Msg(i.encode(), n) for n, i in enumerate(ids)])
    folder = EntryFolder()
    reasons = [folder.add(i) for i in ids]
    assert {k: (bytes(m.bits), m.count, m.max_index) for k, m in f.masks.items()} == {
        k: (bytes(m.bits), m.count, m.max_index) for k, m in folder.masks.items()
    }
    # the same entries set aside for the same kind of reason (a non-ASCII message is refused whole)
    assert [(e.decode(), r.split(":")[0]) for _, e, r, _, _ in f.bad] == [
        (i, r.split(":")[0]) for i, r in zip(ids, reasons) if r is not None
    ]


def test_fold_messages_sets_bad_entries_aside():
    f = fold_messages(
        [
            Msg(b"1:0:0,1:0:2-4", 5),
            Msg(b"1:0:x,1:1:8192,1:1:1", 6),
            Msg(None, 7),
            Msg(b"\xff", 8),
            Msg(b"1:0:3", 9),
            Msg(b"1:0:3", 10),
            Msg(b"1:0:99999", 11),
        ]
    )  # the single-id fast path
    assert sorted(f.masks) == [(1, 0), (1, 1)]
    assert bytes(f.masks[(1, 0)].bits).rstrip(b"\0") == bytes([0b10111000]) and f.masks[(1, 1)].count == 1
    assert f.masks[(1, 0)].max_index == 4
    assert [(e, r.split(":")[0]) for _, e, r, _, _ in f.bad] == [
        (b"1:0:x", "malformed"),
        (b"1:1:8192", "index out of range"),
        (None, "malformed"),
        (b"\xff", "malformed"),
        (b"1:0:99999", "index out of range"),
    ]
    assert f.masks[(1, 0)].count == 4 + 2  # duplicates are counted: the database tells which bits flipped
    assert (f.first, f.last, f.messages) == ({0: 5}, {0: 11}, 7)
    # polls interleave partitions in runs; first and last offsets are per partition
    f = fold_messages(
        [Msg(b"1:0:1", 3, partition=1), Msg(b"1:0:2", 4, partition=1), Msg(b"2:0:1", 7), Msg(b"1:0:3", 5, partition=1)]
    )
    assert (f.first, f.last, f.messages) == ({1: 3, 0: 7}, {1: 5, 0: 7}, 4)
