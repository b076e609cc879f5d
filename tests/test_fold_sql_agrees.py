"""The Python folder (tracker.folding) and the SQL `ack` function fold alike: on the same random
ids they build the same masks, count the same ids, and refuse the same calls naming the same entry
with the same kind of error. SQL callers cannot call Python, so the fold is written twice; this
keeps the two from drifting apart. Runs against the real Postgres."""

from __future__ import annotations

import os

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg import sql

import tracker
from tracker.errors import IndexOutOfRange, MalformedItemId, TooManyGroups
from tracker.folding import GROUP_BITS_MAX, MASK_BYTES_MAX, EntryFolder, fold

GROUPS = 3  # per batch, each of GROUP_BITS_MAX items, so every index the grammar allows exists
EXAMPLES = int(os.environ.get("FOLD_SQL_EXAMPLES", "150"))
_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Entries are drafted with the batch as a placeholder ('B0', 'B1'), filled with the real ids.
_batch = st.sampled_from(["B0", "B1"])
_group = st.integers(0, GROUPS - 1).map(str)
_index = st.integers(0, GROUP_BITS_MAX - 1)
_single = st.builds(lambda b, g, i: f"{b}:{g}:{i}", _batch, _group, _index)
_run = st.builds(
    lambda b, g, i, n: f"{b}:{g}:{i}-{min(i + n, GROUP_BITS_MAX - 1)}", _batch, _group, _index, st.integers(0, 700)
)
# a batch or group id as a client might get it wrong (valid ids of no batch are another matter)
_bad_id = st.one_of(
    st.integers(0, 99).map(lambda i: f"0{i}"),  # leading zero
    st.sampled_from(["", "x", "-1", " 3", "3 ", "3\n", "+3", "1e3", "٣", "3.0", "0x1f"]),
    st.sampled_from([str(2**63), "9" * 20, "1" + "0" * 30, "0" + str(2**63 - 1)]),  # past a bigint
)
# an index as a client might get it wrong
_bad_part = st.one_of(
    _bad_id,
    st.integers(GROUP_BITS_MAX, 10**6).map(str),  # no group holds this index
    st.integers(GROUP_BITS_MAX, 10**5).map(lambda i: f"0{i}"),  # and written with a leading zero
)
_malformed = st.one_of(
    st.builds(lambda p, g, i: f"{p}:{g}:{i}", _bad_id, _group, _index),
    st.builds(lambda b, p, i: f"{b}:{p}:{i}", _batch, _bad_id, _index),
    st.builds(lambda b, g, p: f"{b}:{g}:{p}", _batch, _group, _bad_part),
    st.builds(lambda b, g, i, p: f"{b}:{g}:{i}-{p}", _batch, _group, _index, _bad_part),
    st.builds(lambda b, g, i, j: f"{b}:{g}:{max(i, j)}-{min(i, j) - 1}", _batch, _group, _index, _index),
    st.sampled_from(["", ":", "B0", "B0:0", "B0:0:1:2", "B0::1", "B0:0:1-", "B0:0:-1", "B0:0:1--2", "B0;0;1"]),
)
_entries = st.lists(st.one_of(_single, _single, _run, _malformed), max_size=25)


@pytest.fixture
def batches(conn, schema):
    """Two open batches of GROUPS whole groups each, committed; every example runs in a savepoint."""
    ids = []
    for _ in range(2):
        batch = tracker.open_batch(conn, schema=schema)
        handles = tracker.add_items(conn, batch, GROUPS * GROUP_BITS_MAX, schema=schema)
        assert [(h.group_id, h.upto) for h in handles] == [(g, GROUP_BITS_MAX) for g in range(GROUPS)]
        ids.append(batch.id)
    conn.commit()
    return ids


def _fill(entries: list[str], batch_ids: list[int]) -> list[str]:
    return [e.replace("B0", str(batch_ids[0])).replace("B1", str(batch_ids[1])) for e in entries]


def _python(entries: list[str]) -> tuple:
    """("ok", {key: mask bytes}, ids folded) or ("refused", SQLSTATE the SQL ack uses, entry named)."""
    try:
        masks = fold(entries)
    except MalformedItemId as exc:
        return ("refused", "RT001", exc.item_id)
    except IndexOutOfRange as exc:
        return ("refused", "RT004", exc.item_id)
    except TooManyGroups as exc:
        return ("refused", "RT008", exc.item_id)
    bits = {k: bytes(m.bits).ljust(GROUP_BITS_MAX >> 3, b"\0") for k, m in masks.items() if any(m.bits)}
    return ("ok", bits, sum(m.count for m in masks.values()))


def _sql(conn, schema: str, entries: list[str]) -> tuple:
    """The same for the SQL ack, from what it cleared (every bit was set): rolled back after."""
    try:
        with conn.transaction():  # a savepoint: the example leaves nothing behind
            acked, duplicates, _ = conn.execute(
                # the masked path: bits cleared at once (a claim clears them at commit)
                sql.SQL("SELECT * FROM {}.ack(%s, claims => false)").format(sql.Identifier(schema)),
                [entries],
            ).fetchone()
            rows = conn.execute(
                sql.SQL("SELECT batch_id, id, (~bits)::text FROM {} WHERE bits <> ~(bits # bits)").format(
                    sql.Identifier(schema, "batch_group")
                )
            ).fetchall()
            raise _Undo(acked, duplicates, rows)
    except _Undo as undo:
        acked, duplicates, rows = undo.args
    except psycopg.Error as exc:
        return ("refused", exc.sqlstate, exc.diag.message_detail)
    bits = {(b, g): int(cleared, 2).to_bytes(GROUP_BITS_MAX >> 3, "big") for b, g, cleared in rows}
    assert acked == sum(int.from_bytes(m, "big").bit_count() for m in bits.values())
    return ("ok", bits, acked + duplicates)


class _Undo(Exception):
    """Rolls the savepoint back, carrying what was read inside it."""


@_SETTINGS
@given(entries=_entries)
@example(entries=["B0:0:1", "B0:0:1", "B1:2:0-8191", "B0:0:7-9"])
@example(entries=["B0:0:1", "B0:0:01"])
@example(entries=["B0:1:5-3", "B0:0:8192"])
def test_python_and_sql_fold_the_same_ids_alike(conn, schema, batches, entries):
    entries = _fill(entries, batches)
    assert _sql(conn, schema, entries) == _python(entries)


def test_an_index_with_a_leading_zero_past_any_group_is_malformed_in_sql_too(conn, schema):
    assert _sql(conn, schema, ["1:0:08192"]) == ("refused", "RT001", "1:0:08192")


@_SETTINGS
@given(entry=st.one_of(_single, _run, _malformed))
def test_each_entry_is_taken_or_refused_alike_by_the_acker_fold_and_sql(conn, schema, batches, entry):
    """Entry by entry, as the acker folds (bad entries set aside with a reason): the SQL ack takes
    exactly the entries EntryFolder takes, and refuses the others for the same kind of reason."""
    (entry,) = _fill([entry], batches)
    folder = EntryFolder()
    reason = folder.add(entry)
    got = _sql(conn, schema, [entry])
    if reason is None:
        bits = {k: bytes(m.bits) for k, m in folder.masks.items()}
        assert got == ("ok", bits, sum(m.count for m in folder.masks.values()))
    else:
        want = "RT004" if reason.startswith("index out of range") else "RT001"
        assert got == ("refused", want, entry)


# Near the bound: whole groups up to a little short of MASK_BYTES_MAX, then random entries that may
# take the masks past it (a mask grows a byte per 8 indexes up to its group's highest). Both must
# refuse at the same entry, or neither (the groups do not exist, so SQL then names one: RT002).
_NEAR = MASK_BYTES_MAX // (GROUP_BITS_MAX >> 3) - 12
_tail_entry = st.one_of(
    st.builds(lambda g, i: f"{10**7 + g}:0:{i}", st.integers(0, 30), _index),
    st.builds(lambda g, i, n: f"{10**7 + g}:0:{i}-{min(i + n, 8191)}", st.integers(0, 30), _index, st.integers(0, 9)),
    st.builds(lambda g: f"{10**6 + g}:0:0-8191", st.integers(0, _NEAR - 1)),  # a group already whole
    _malformed.map(lambda e: e.replace("B0", "5").replace("B1", "6")),
)


@settings(
    max_examples=max(10, EXAMPLES // 10),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(tail=st.lists(_tail_entry, min_size=1, max_size=40))
def test_python_and_sql_refuse_the_same_entry_past_the_mask_bound(conn, schema, tail):
    entries = [f"{10**6 + g}:0:8191" for g in range(_NEAR)] + tail
    py = _python(entries)
    got = _sql(conn, schema, entries)
    if py[0] == "ok":
        assert got[:2] == ("refused", "RT002")  # folded alike; then its batches are unknown
    else:
        assert got == py
