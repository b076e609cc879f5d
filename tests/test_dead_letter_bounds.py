"""Bad ack entries cost in proportion to the bytes that carry them: a message of more than
BAD_ENTRIES_MAX malformed entries is one dead letter, whole; the entries the database rejects are
one letter per group and reason; the Spark fold emits bad entries in rounds, as it does masks.
(The bounds on masks and groups: test_bounded_cost.py.)"""

from __future__ import annotations

import tracemalloc

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from support.acking import batch_state, committed, make_acker, produce_raw, running
from support.harness import read_messages, wait_for
from test_bounded_cost import _closed_batches
from test_folding import Msg

from tracker.folding import fold_arrow, fold_messages
from tracker.folding.messages import BAD_ENTRIES_MAX, FAILURE_REASON_HEADER

JUNK = b",".join([b"x"] * 450_000)  # 900 KB of bad entries, under the broker's 1 MB record limit


@settings(max_examples=120, deadline=None)
@given(
    good=st.lists(st.integers(0, 40), max_size=30),
    bad=st.integers(0, 2 * BAD_ENTRIES_MAX + 5),
    failing=st.booleans(),
    seed=st.randoms(use_true_random=False),
)
def test_a_message_of_many_bad_entries_is_set_aside_once_whole(good, bad, failing, seed):
    """Up to BAD_ENTRIES_MAX bad entries of a message are set aside one by one; past that, the
    message once, whole, with the count. Its good entries are folded either way, as acks or (a
    message of failures, in a fold that already holds failures) as failures."""
    entries = [f"7:0:{i}" for i in good] + ["x"] * bad
    seed.shuffle(entries)
    if not entries:
        return
    mark = "!" if failing else ""
    value = ",".join(mark + e for e in entries).encode()
    header = [(FAILURE_REASON_HEADER, b"why")] if failing else None
    before = [Msg(b"!9:0:1", 0, headers=[(FAILURE_REASON_HEADER, b"other")])] if failing else []
    folded = fold_messages([*before, Msg(value, len(before), headers=header)])
    assert folded.messages == len(before) + 1 and not folded.rest
    if bad <= BAD_ENTRIES_MAX:
        assert [b[1] for b in folded.bad] == [(mark + "x").encode()] * bad
    else:
        ((key, whole, reason, partition, offset),) = folded.bad
        assert whole == value and (partition, offset) == (0, len(before))
        assert reason.startswith(f"{bad} of its {len(entries)} entries could not be applied; the first: "), reason
    assert all(0 <= n < len(folded.bad) for n in folded.bad_failure)
    assert folded.bad_failure == ({n: b"why" for n in range(len(folded.bad))} if failing else {})
    steps = dict(folded.steps)
    outcome = "why" if failing else None
    bits = {
        (b, g): int.from_bytes(m.bits.ljust(1024, b"\0"), "big")
        for b, g in [(7, 0)]
        for m in [steps.get(outcome, {}).get((b, g))]
        if m is not None
    }
    expect = sum(1 << (8191 - i) for i in set(good))
    assert bits.get((7, 0), 0) == expect


def test_one_junk_message_costs_memory_in_proportion_to_its_bytes():
    tracemalloc.start()
    try:
        folded = fold_messages([Msg(JUNK, 0)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(folded.bad) == 1
    assert peak < 40 * len(JUNK), f"{len(JUNK)} bytes -> {peak / 1e6:.0f} MB"


def test_the_acker_dead_letters_a_junk_message_once_and_applies_its_good_entries(
    pg_dsn, schema, kafka_bootstrap, topics
):
    topic, dlq = topics("acks"), topics("acks-dead")
    (batch,), (handle,) = _closed_batches(pg_dsn, schema, 1, 3)
    value = b",".join([b"x"] * 200) + f",{batch.id}:0:0-2".encode()
    produce_raw(kafka_bootstrap, topic, [(b"1", JUNK), (str(batch.id).encode(), value)])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq)
    with running(acker):
        wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [2], timeout=120, what="offsets")
    letters = read_messages(kafka_bootstrap, dlq, 2)
    assert [m.value() for m in letters] == [JUNK, value]
    assert [dict(m.headers())["reason"].decode().split(";")[0] for m in letters] == [
        "450000 of its 450000 entries could not be applied",
        "200 of its 201 entries could not be applied",
    ]
    assert batch_state(pg_dsn, schema, batch.id) == ("complete", 0)


def test_the_runs_the_database_rejects_are_one_letter_per_group_and_reason(pg_dsn, schema, kafka_bootstrap, topics):
    """Every other index of a group of an unknown batch is 50 runs; they come back as one letter
    each for the acks and the failures, each a message the ack topic takes again as it is."""
    topic, dlq = topics("acks"), topics("acks-dead")
    acks = ",".join(f"999999:0:{i}" for i in range(0, 100, 2)).encode()
    fails = ",".join(f"!999999:1:{i}" for i in range(1, 100, 2)).encode()
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
    p.produce(topic, key=b"999999", value=acks)
    p.produce(topic, key=b"999999", value=fails, headers=[(FAILURE_REASON_HEADER, b"gone")])
    assert p.flush(30) == 0
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq)
    with running(acker):
        wait_for(lambda: committed(kafka_bootstrap, acker.group, topic, 1) == [2], timeout=120, what="offsets")
    letters = read_messages(kafka_bootstrap, dlq, 2)
    assert sorted((m.value(), dict(m.headers())["reason"]) for m in letters) == sorted(
        [(acks, b"unknown batch"), (fails, b"unknown batch")]
    )
    (failed,) = [m for m in letters if m.value() == fails]
    assert dict(failed.headers())[FAILURE_REASON_HEADER] == b"gone"


def test_the_spark_fold_emits_bad_entries_in_rounds_too():
    """A partition of nothing but bad entries holds at most about max_groups of them at a time."""
    rows = [",".join(["x"] * 50)] * 40 + ["y"] * 300
    batches = [pa.RecordBatch.from_pydict({"item_id": rows[k : k + 64]}) for k in range(0, len(rows), 64)]
    out = list(fold_arrow("item_id", max_groups=25)(iter(batches)))
    assert max(rb.num_rows for rb in out) < 2 * 25 + 64
    assert sum(rb.num_rows for rb in out) == 40 * 50 + 300
