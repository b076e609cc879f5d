"""Rows an outbox table can hold but that cannot be published as written (header arrays of more than
one dimension, a NULL header name, a kafka_partition that is no partition number: an application's
own table, or rows written before `reaper migrate` added its checks) are moved to the dead table
with a reason, in both modes, and hold up nothing: the producing thread never dies on them, and
the other rows are published in order. The screen that finds them (harvester.publishing.unfit_rows)
agrees with the row-by-row rule; the run planner keeps them, and negative partitions, out of
every partition run. Real Kafka and Postgres."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.harness import Receiver, make_config, outbox_marks, running, wait_until

from harvester.publishing.runs import PartitionCounts, plan_runs
from harvester.publishing.unfit_rows import PARTITION_MAX, unfit_reason, unfit_rows

# --- the screen, without services -------------------------------------------------------------

_name = st.one_of(st.text(max_size=5), st.none(), st.lists(st.text(max_size=3), min_size=1, max_size=2))
_value = st.one_of(st.binary(max_size=5), st.none(), st.lists(st.binary(max_size=3), min_size=1, max_size=2))
_partition = st.one_of(st.none(), st.integers(0, 5), st.sampled_from([-1, -7, PARTITION_MAX, PARTITION_MAX + 1]))
_row = st.tuples(
    st.one_of(st.none(), st.lists(_name, max_size=3)), st.one_of(st.none(), st.lists(_value, max_size=3)), _partition
)


def _rows(shapes: list[tuple]) -> list[tuple]:
    return [(i, "t", b"k%d" % i, b"v", hk, hv, p, "mid") for i, (hk, hv, p) in enumerate(shapes)]


@settings(max_examples=400, deadline=None)
@given(st.lists(_row, max_size=12))
def test_the_screen_finds_every_row_whose_names_or_partition_are_unfit_and_only_unfit_rows(shapes):
    rows = _rows(shapes)
    found = unfit_rows(rows)
    for i, (hk, hv, p) in enumerate(shapes):
        # Names and partitions are what produce() would take silently: the screen must find them.
        # (A nested header_values makes produce() itself raise, and the produce loop moves it aside.)
        if unfit_reason(hk, None, p) is not None:
            assert i in found, (i, shapes[i])
        if i in found:
            assert found[i] is not None and found[i] == unfit_reason(hk, hv, p)


def test_the_screen_names_each_reason():
    assert unfit_reason(["a", None], [b"1", b"2"], None) == (
        "header name 2 (of header_keys) is NULL: a Kafka header needs a name"
    )
    assert unfit_reason([["a"], ["b"]], [b"1", b"2"], None).startswith("header_keys is not a one-dimensional array")
    assert unfit_reason(["a", "b"], [[b"1"], [b"2"]], None).startswith("header_values is not a one-dimensional")
    assert unfit_reason([], [], -1).startswith("kafka_partition -1 is not a partition number")
    assert unfit_reason([], [], PARTITION_MAX + 1).startswith(f"kafka_partition {PARTITION_MAX + 1} is not")
    assert unfit_reason(None, None, None) is None  # an application's table may leave both NULL
    assert unfit_rows(_rows([(None, None, None), (["a"], [b"x"], 3)])) == {}


class _NoMetadata:
    def __len__(self) -> int:
        return 0


def test_negative_partitions_and_rows_moved_aside_are_in_no_partition_run():
    rows = [(i, "t", b"key-%d" % i, b"v", [], [], -1, "mid") for i in range(1, 5)]
    parts, runs, last = plan_runs(rows, PartitionCounts(), _NoMetadata(), {})
    assert runs == [-1, -1, -1, -1] and not any(last)
    # Explicit partition 0 for all: one run; the last row set apart, the one before it settles the run.
    rows = [(i, "t", b"key", b"v", [], [], 0, "mid") for i in range(1, 5)]
    parts, runs, last = plan_runs(rows, PartitionCounts(), _NoMetadata(), {}, {3: "unfit"})
    assert runs == [0, 0, 0, -1] and last == [False, False, True, False]


# --- the harvester, end to end ----------------------------------------------------------------

_CHECKS = (
    "outbox_header_keys_flat",
    "outbox_header_values_flat",
    "outbox_header_names_not_null",
    "outbox_kafka_partition_check",
)

# (header_keys, header_values, kafka_partition) as SQL, and the reason's start
_UNFIT = [
    ("'{a,b}'", "'{{\\\\x01},{\\\\x02}}'", "NULL", "header_values is not a one-dimensional array"),
    ("'{{a},{b}}'", "'{\\\\x01,\\\\x02}'", "NULL", "header_keys is not a one-dimensional array"),
    ("ARRAY['a', NULL]", "'{\\\\x01,\\\\x02}'", "NULL", "header name 2 (of header_keys) is NULL"),
    ("'{}'", "'{}'", "-1", "kafka_partition -1 is not a partition number"),
]


# Alone among well-formed rows, a nested header_values passes the screen: produce() raises TypeError
# for it, and the produce loop moves it aside (what stopped the producing thread before).
@pytest.mark.parametrize("unfit", [_UNFIT, _UNFIT[:1]], ids=["each-kind", "nested-values-alone"])
@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
def test_rows_that_cannot_be_published_as_written_are_moved_aside_and_hold_up_nothing(
    pg_dsn, kafka_bootstrap, schema, topics, fenced, unfit
):
    topic = topics("data", partitions=1)
    dead_ids, reasons = [], []
    with psycopg.connect(pg_dsn) as c:
        # An application's own table without reaper migrate's checks (or rows written before them).
        c.execute(f'ALTER TABLE "{schema}".outbox ' + ", ".join(f"DROP CONSTRAINT {name}" for name in _CHECKS))
        for n, (keys, values, partition, reason) in enumerate(unfit):
            c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s)', [topic, b"k", b"%d" % n]
            )
            dead_ids.append(
                c.execute(
                    f'INSERT INTO "{schema}".outbox (topic, key, value, header_keys, header_values, kafka_partition) '
                    f"VALUES (%s, 'k', 'bad', {keys}, {values}, {partition}) RETURNING id",
                    [topic],
                ).fetchone()[0]
            )
            reasons.append(reason)
        c.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value, header_keys, header_values) '
            "VALUES (%s, 'k', 'last', '{h}', '{\\\\x07}')",
            [topic],
        )
    receiver = Receiver(kafka_bootstrap, topic, 1, {"isolation.level": "read_committed"})
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    try:
        with running(make_config(pg_dsn, schema, kafka_bootstrap, harvester=fencing), drain_timeout=3) as h:
            good = [b"%d" % n for n in range(len(unfit))] + [b"last"]
            published = wait_until(lambda: len(receiver.values()) >= len(good) or h.error is not None, 60)
            assert h.error is None, f"the harvester died on a row: {h.error!r}"
            assert published, f"got {receiver.values()}; outbox {outbox_marks(pg_dsn, schema)}"
            assert wait_until(lambda: not outbox_marks(pg_dsn, schema), 30), outbox_marks(pg_dsn, schema)
        assert receiver.values() == good
        assert all(b"bad" != v for v in receiver.values())
        with psycopg.connect(pg_dsn) as c:
            dead = c.execute(f'SELECT id, reason FROM "{schema}".outbox_dead ORDER BY id').fetchall()
        assert [d[0] for d in dead] == dead_ids
        for (_, got), wanted in zip(dead, reasons):
            assert got.startswith(wanted), (got, wanted)
        assert all(name != "None" for _, _, hs in receiver.snapshot() for name, _ in hs)
    finally:
        receiver.close()
