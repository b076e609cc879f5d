"""The folds agree: Spark's vectorised fold (Arrow + numpy) and the acker's message fold give the
same masks and the same bad entries as folding the valid entries one by one. No JVM needed."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from support.messages import Msg

from tracker.folding import EntryFolder, fold_arrow, fold_messages
from tracker.ids import fold

valid = st.builds(lambda b, g, i: f"{b}:{g}:{i}", st.integers(0, 3), st.integers(0, 3), st.integers(0, 8191))
runs = st.builds(
    lambda b, g, i, n: f"{b}:{g}:{i}-{min(i + n, 8191)}",
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(0, 8191),
    st.integers(0, 300),
)
bad = st.sampled_from(
    [
        "",
        "x",
        "1:2",
        "1:2:3:4",
        "1:0:8192",
        "1:0:5-3",
        "1:0:-1",
        "1:0:99999999999",
        "1:0: 3",
        "1:0:3x",
        "\u0661:0:1",
        "1:0:1-9000",
    ]
)
entries = st.lists(st.one_of(valid, valid, runs, bad), max_size=60)


def _masks(folded) -> dict:
    return {k: (bytes(m.bits).rstrip(b"\0"), m.count) for k, m in folded.items() if m.count}


def _rejected(out) -> list[tuple[str, str]]:
    return [(b, r) for b, r in zip(out.column("bad").to_pylist(), out.column("reason").to_pylist()) if b is not None]


def _expected(values: list[str], not_ascii: str) -> tuple[dict, list[tuple[str, str]]]:
    """The model: a value that is not ASCII is one bad entry as a whole (with reason `not_ascii`);
    otherwise each ','-separated entry is folded or rejected on its own. Rejections are
    (entry, reason) pairs: the reason may not depend on where the entry came in the input."""
    folder = EntryFolder()
    rejected = [(v, not_ascii) for v in values if not v.isascii()]
    for v in values:
        if v.isascii():
            for e in v.split(","):
                reason = folder.add(e)
                if reason is not None:
                    rejected.append((e, reason))
    return _masks(folder.masks), rejected


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.one_of(entries.map(lambda es: ",".join(es)), valid, valid), max_size=40),
    st.sampled_from([pa.string(), pa.binary()]),  # Kafka values arrive as binary
)
def test_spark_fold_matches_the_entry_fold(values, typ):
    want, want_bad = _expected(values, "malformed: not ASCII")
    # every good entry is also what tracker.ids.fold makes of it
    bad_entries = {e for e, _ in want_bad}
    good = [e for v in values if v.isascii() for e in v.split(",") if e not in bad_entries]
    assert _masks(fold(good)) == want
    batches = [
        pa.RecordBatch.from_pydict(
            {"ack": [v if typ == pa.string() else v.encode() for v in values[k : k + 7]]},
            schema=pa.schema([("ack", typ)]),
        )
        for k in range(0, len(values), 7)
    ]
    (out,) = list(fold_arrow("ack")(iter(batches)))
    got: dict = {}
    for b, g, mask, n in zip(*(out.column(c).to_pylist() for c in ("batch_id", "group_id", "mask", "folded"))):
        if b is None:
            continue
        bits, count = got.get((b, g), (0, 0))
        got[(b, g)] = (bits | int.from_bytes(mask.ljust(1024, b"\0"), "big"), count + n)
    got = {k: (v[0].to_bytes(1024, "big").rstrip(b"\0"), v[1]) for k, v in got.items()}
    assert got == want
    if typ == pa.binary():  # bytes that are not ASCII are named as decoded with replacement
        want_bad = [(b.encode().decode("ascii", "replace"), r) for b, r in want_bad]
    assert sorted(_rejected(out)) == sorted(want_bad)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(entries.map(lambda es: ",".join(es)), valid, valid), max_size=40))
def test_acker_fold_matches_the_entry_fold(values):
    want, want_bad = _expected(values, "malformed: value is empty or not ASCII")
    f = fold_messages([Msg(v.encode(), k, key=None) for k, v in enumerate(values)])
    assert _masks(f.masks) == want
    assert sorted((e.decode(), r) for _, e, r, _, _ in f.bad) == sorted(want_bad)


def test_spark_fold_bigint_edges_and_binary_values_match_the_entry_fold():
    edges = [
        "9223372036854775807:4611686018427387904:8191",
        "9223372036854775808:1:1",
        "1:9223372036854775808:1",
        "0123:0009223372036854775807:0",
        "99999999999999999999:1:1",
        "1:4611686018427387904:8192",
        "1:4611686018427387904:0",
        "12:34:0001",
    ]
    want, want_bad = _expected(edges, "malformed: not ASCII")
    for typ, vals in ((pa.string(), edges), (pa.binary(), [e.encode() for e in edges])):
        batch = pa.RecordBatch.from_pydict({"ack": vals}, schema=pa.schema([("ack", typ)]))
        (out,) = list(fold_arrow("ack")(iter([batch])))
        got = {
            (b, g): (m.rstrip(b"\0"), n)
            for b, g, m, n in zip(*(out.column(c).to_pylist() for c in ("batch_id", "group_id", "mask", "folded")))
            if b is not None
        }
        assert got == want
        assert sorted(_rejected(out)) == sorted(want_bad)
