"""What an ack costs is bounded by what the caller sent, on every path, whatever the ids name.

The rule: folding acks allocates at most MASK_BYTES_MAX (4 MiB) of masks, plus memory in
proportion to the ids themselves; a call past that is refused (TooManyGroups, RT008, HTTP 413)
before the masks past the limit exist, and nothing is applied. The acker and Spark, which cannot
refuse what they consume, fold and apply in rounds of at most GROUPS_PER_FOLD_MAX groups. Each path
gets its worst input for its limits here: the Python fold (peak memory measured), the Python API
(sync and asyncio), the SQL function, the HTTP service (both backends), the acker on a real Kafka,
and the Spark fold.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc

import httpx
import psycopg
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.acking import batch_state, committed, make_acker, produce_raw, running
from support.harness import read_messages, wait_for
from support.http_server import TOKEN, RunningServer, http_config
from test_folding import Msg
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker.errors import MalformedItemId, TooManyGroups
from tracker.folding import GROUPS_PER_FOLD_MAX, MASK_BYTES_MAX, fold, fold_arrow, fold_messages
from tracker.folding.entries import _fold_each

# One past the limit: 4,097 groups whose masks would each take a whole KiB.
OVER_LIMIT = GROUPS_PER_FOLD_MAX + 1


def _input_bytes(ids: list[str]) -> int:
    return len(json.dumps(ids))


def _peak(call) -> tuple[object, int]:
    tracemalloc.start()
    try:
        try:
            result = call()
        except TooManyGroups as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


WORST = {
    # every id in a group of its own, at the highest index: 1 KiB of mask per 10 bytes sent
    "distinct groups at the last index": lambda n: [f"{i}:0:8191" for i in range(n)],
    "distinct groups, whole runs": lambda n: [f"{i}:0:0-8191" for i in range(n)],
    "distinct small groups": lambda n: [f"{i}:{i}:3" for i in range(n)],
    "one batch, 13 groups": lambda n: [f"1:{i % 13}:{i // 13 % 8192}" for i in range(n)],
}


@pytest.mark.parametrize("shape", list(WORST))
def test_the_fold_of_the_worst_request_stays_within_its_stated_bound(shape):
    """The default HTTP limit is 100,000 ids a request: the fold's peak is at most the masks'
    limit plus 32 bytes per byte of the request (Python's objects for the ids and groups), plus
    1 MiB. Before, 100,000 distinct groups cost 819 MB."""
    ids = WORST[shape](100_000)
    result, peak = _peak(lambda: fold(ids))
    bound = MASK_BYTES_MAX + 32 * _input_bytes(ids) + (1 << 20)
    assert peak <= bound, f"{shape}: peak {peak:,} bytes > bound {bound:,}"
    if shape.startswith("distinct groups"):
        assert isinstance(result, TooManyGroups)
        assert result.item_id == ids[GROUPS_PER_FOLD_MAX]  # named as written: the first past the limit
        assert "split them into several calls" in str(result)


def test_exactly_at_the_limit_is_taken_one_past_it_is_refused():
    assert len(fold([f"{i}:0:0-8191" for i in range(GROUPS_PER_FOLD_MAX)])) == GROUPS_PER_FOLD_MAX
    with pytest.raises(TooManyGroups) as raised:
        fold([f"{i}:0:0-8191" for i in range(OVER_LIMIT)])
    assert raised.value.item_id == f"{GROUPS_PER_FOLD_MAX}:0:0-8191"


entry = st.one_of(
    st.builds(lambda b, g, i: f"{b}:{g}:{i}", st.integers(0, 30), st.integers(0, 3), st.integers(0, 8191)),
    st.builds(
        lambda b, g, i, n: f"{b}:{g}:{i}-{min(i + n, 8191)}",
        st.integers(0, 30),
        st.integers(0, 3),
        st.integers(0, 8191),
        st.integers(0, 9000),
    ),
)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(entry, min_size=1, max_size=80), limit=st.integers(1, 40_000))
def test_a_fold_is_refused_exactly_when_its_masks_would_pass_the_limit(ids, limit):
    unbounded = _fold_each(ids, max_mask_bytes=1 << 62)
    need = sum((m.max_index >> 3) + 1 for m in unbounded.values())
    if need <= limit:
        masks = fold(ids, max_mask_bytes=limit)
        assert {k: (bytes(m.bits), m.count) for k, m in masks.items()} == {
            k: (bytes(m.bits), m.count) for k, m in unbounded.items()
        }
        assert sum(len(m.bits) for m in masks.values()) <= limit
    else:
        with pytest.raises(TooManyGroups) as raised:
            fold(ids, max_mask_bytes=limit)
        assert raised.value.item_id in ids


# ---------------------------------------------------------------- the Python API, both faces


def _state(conn, schema):
    return conn.execute(f'SELECT id, state, pending FROM "{schema}".batch ORDER BY id').fetchall()


def test_the_python_api_refuses_the_worst_ack_and_the_transaction_is_untouched(conn, schema):
    batch = tracker.open_batch(conn, schema=schema)
    (handle,) = tracker.add_items(conn, batch, 10, schema=schema)
    before = _state(conn, schema)
    worst = [f"{batch.id}:0:0-9"] + [f"{i}:0:8191" for i in range(10**6, 10**6 + OVER_LIMIT)]
    with pytest.raises(TooManyGroups):
        tracker.ack(conn, worst, schema=schema)
    assert _state(conn, schema) == before  # nothing applied, the transaction goes on
    assert tracker.ack(conn, handle.item_ids, schema=schema).acked == 10


@pytest.mark.parametrize("index", ["0", "8191", "0-8191"])
def test_a_whole_ack_call_stays_within_its_stated_bound_on_existing_groups(conn, schema, index):
    """The worst accepted call: every existing group of 4,096 whole ones named, at its last index.
    What the call holds (masks, their hex, the statement's parameters) stays under 8 times the
    masks' limit plus 48 bytes per byte of ids plus 2 MiB; masks are sent as folded and padded
    to their group's size by the statement."""
    batch = tracker.open_batch(conn, schema=schema)
    handles = tracker.add_items(conn, batch, 8192 * GROUPS_PER_FOLD_MAX, schema=schema)
    ids = [f"{batch.id}:{h.group_id}:{index}" for h in handles]
    result, peak = _peak(lambda: tracker.ack(conn, ids, schema=schema, claims=False))
    assert not isinstance(result, TooManyGroups)
    assert result.acked == len(ids) * (8192 if "-" in index else 1)
    bound = 8 * MASK_BYTES_MAX + 48 * _input_bytes(ids) + (2 << 20)
    assert peak <= bound, f"peak {peak:,} bytes > bound {bound:,}"
    assert invariant_violations(conn, schema) == []


def test_the_asyncio_face_refuses_it_too(pg_dsn, schema):
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            t = tracker.AsyncTracker(schema=schema, registry=None)
            batch = await t.open_batch(aconn)
            await t.add_items(aconn, batch, 3)
            with pytest.raises(TooManyGroups):
                await t.ack(aconn, [f"{i}:1:8191" for i in range(OVER_LIMIT)])
            status = await t.status(aconn, batch)
            assert status.pending == 3
            await aconn.rollback()

    asyncio.run(main())


# ---------------------------------------------------------------- SQL


def test_the_sql_ack_refuses_the_worst_call_before_building_masks_and_folds_runs_without_rows(conn, schema):
    batch = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, batch, 8192, schema=schema)
    before = _state(conn, schema)
    worst = [f"{batch.id}:0:0-8191"] + [f"{i}:0:0-8191" for i in range(10**6, 10**6 + GROUPS_PER_FOLD_MAX)]
    conn.execute("SAVEPOINT worst")
    with pytest.raises(psycopg.Error) as raised:
        conn.execute(f'SELECT * FROM "{schema}".ack(%s)', [worst])
    assert raised.value.sqlstate == "RT008"
    assert raised.value.diag.message_detail == worst[GROUPS_PER_FOLD_MAX]
    conn.execute("ROLLBACK TO SAVEPOINT worst")
    assert _state(conn, schema) == before
    # 2,000 copies of a whole group's run (each a row per index before, 16 million rows): one pass.
    acked, duplicates, _completed = conn.execute(
        f'SELECT * FROM "{schema}".ack(%s)', [[f"{batch.id}:0:0-8191"] * 2000]
    ).fetchone()
    assert (acked, duplicates) == (8192, 8192 * 1999)
    assert invariant_violations(conn, schema) == []


WHOLE = [f"{10**6 + i}:0:0-8191" for i in range(GROUPS_PER_FOLD_MAX - 1)]


@pytest.mark.parametrize(
    "ids",
    [
        ["1:0:0", "2:0:0", *WHOLE, "1:0:8191"],  # the growth of a group named before takes it past
        [*WHOLE, "5:5:5", "6:6:6-8191"],
        [*WHOLE, "5:5:5", "6:6:6-8191", "not-an-id"],  # malformed entries are named first
        [*WHOLE, "05:5:4095", "5:05:4096-8191", "7:0:0"],  # leading zeros: malformed on both
    ],
    ids=["earlier-group", "last-entry", "malformed-later", "spellings"],
)
def test_the_sql_ack_and_the_python_fold_refuse_the_same_calls_naming_the_same_entry(conn, schema, ids):
    try:
        fold(ids)
        expected = None
    except TooManyGroups as exc:
        expected = ("RT008", exc.item_id)
    except MalformedItemId as exc:
        expected = ("RT001", exc.item_id)
    conn.execute("SAVEPOINT sql_ack")
    try:
        conn.execute(f'SELECT * FROM "{schema}".ack(%s)', [ids])
        got = None
    except psycopg.Error as exc:
        got = (exc.sqlstate, exc.diag.message_detail)
    conn.execute("ROLLBACK TO SAVEPOINT sql_ack")
    assert expected is not None and got == expected


# ---------------------------------------------------------------- HTTP, both backends


@pytest.mark.parametrize("backend", ["tracker", "sql"])
def test_the_http_service_answers_the_worst_request_with_413_and_keeps_serving(pg_dsn, schema, backend):
    cfg = http_config(pg_dsn, schema, backend=backend)
    with (
        RunningServer(cfg, [TOKEN]) as server,
        httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as client,
    ):
        batch_id = client.post("/v1/batches", json={}).json()["batch_id"]
        worst = [f"{i}:0:8191" for i in range(10**6, 10**6 + OVER_LIMIT)]
        r = client.post("/v1/acks", json={"ids": worst})
        assert r.status_code == 413, r.text
        problem = r.json()
        assert problem["type"].endswith(":payload-too-large") and problem["field"] == "body.ids"
        assert problem["item_id"] == worst[GROUPS_PER_FOLD_MAX]
        assert client.get(f"/v1/batches/{batch_id}").status_code == 200  # still serving


# ---------------------------------------------------------------- the acker's folds


message_values = st.lists(
    st.lists(entry, min_size=1, max_size=6).map(lambda es: ",".join(es).encode()), min_size=1, max_size=60
)


@settings(max_examples=200, deadline=None)
@given(values=message_values, max_groups=st.integers(1, 12), partitions=st.integers(1, 3))
def test_folds_of_a_poll_in_rounds_hold_at_most_max_groups_and_add_up_to_the_whole(values, max_groups, partitions):
    messages = [Msg(v, offset=i // partitions, partition=i % partitions) for i, v in enumerate(values)]
    got: dict = {}
    bad: list = []
    rest, rounds = messages, 0
    while rest:
        folded = fold_messages(rest, max_groups=max_groups)
        rounds += 1
        assert folded.messages >= 1  # every round makes progress
        assert len(folded.masks) <= max_groups or folded.messages == 1
        for key, m in folded.masks.items():
            acc = got.setdefault(key, [0, 0])
            acc[0] |= int.from_bytes(m.bits, "big")
            acc[1] += m.count
        bad += folded.bad
        # the offsets a round reports are exactly those of the messages it folded
        done = rest[: folded.messages]
        assert folded.last == {p: max(m.offset() for m in done if m.partition() == p) for p in folded.last}
        assert folded.first == {p: min(m.offset() for m in done if m.partition() == p) for p in folded.first}
        assert set(folded.first) == {m.partition() for m in done}
        rest = folded.rest
    too_large = [b for b in bad if b[2].startswith("too large")]
    for b in too_large:  # set aside whole, never half-folded
        assert len({e.rpartition(b":")[0] for e in b[1].split(b",")}) > max_groups
    # the rounds add up to one fold of the messages that were not too large
    kept = [m for m in messages if all(m.value() is not b[1] for b in too_large)]
    expect_whole = fold_messages(kept, max_groups=10**9)
    expect = {k: [int.from_bytes(m.bits, "big"), m.count] for k, m in expect_whole.masks.items()}
    assert got == expect
    assert [b[1:] for b in bad if not b[2].startswith("too large")] == [b[1:] for b in expect_whole.bad]


def test_a_message_naming_more_groups_than_a_fold_holds_is_set_aside_as_too_large():
    big = ",".join(f"{i}:0:1" for i in range(GROUPS_PER_FOLD_MAX + 5)).encode()
    folded = fold_messages([Msg(b"1:0:1", 0), Msg(big, 1), Msg(b"1:0:2", 2)])
    assert folded.messages == 3 and not folded.rest
    assert [(b[1] == big, b[2].split(":")[0]) for b in folded.bad] == [(True, "too large")]
    (mask,) = folded.masks.values()
    assert mask.count == 2


def _closed_batches(pg_dsn: str, schema: str, n: int, items: int) -> tuple[list, list]:
    """n closed batches of `items` items each (one group each): (batches, their group handles)."""
    with psycopg.connect(pg_dsn) as c:
        batches = [tracker.open_batch(c, schema=schema) for _ in range(n)]
        handles = [h for b in batches for h in tracker.add_items(c, b, items, schema=schema)]
        for b in batches:
            tracker.close_batch(c, b, schema=schema)
        c.commit()
    return batches, handles


def test_the_acker_applies_a_poll_of_many_groups_in_bounded_rounds_and_rewinds_without_loss(
    pg_dsn, schema, kafka_bootstrap, topics
):
    """60 groups in one poll, at most 8 a round; the database away for the first rounds."""
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    batches, handles = _closed_batches(pg_dsn, schema, 60, 3)
    assert len({(h.batch_id, h.group_id) for h in handles}) == 60
    ids = [i for h in handles for i in h.item_ids]
    too_large = ",".join(f"{10**6 + i}:0:0" for i in range(40)).encode()  # 40 groups > 8
    produce_raw(
        kafka_bootstrap,
        topic,
        [(str(n % 2).encode(), i.encode()) for n, i in enumerate(ids[:90])]
        + [(b"0", too_large)]
        + [(str(n % 2).encode(), i.encode()) for n, i in enumerate(ids[90:])],
    )
    hidden = f"{schema}_away"
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'ALTER SCHEMA "{schema}" RENAME TO "{hidden}"')
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, max_groups=8, retry_backoff=0.2)
    try:
        with running(acker):
            wait_for(lambda: acker.stats["retries"] >= 2, what="failed rounds")
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                c.execute(f'ALTER SCHEMA "{hidden}" RENAME TO "{schema}"')
            wait_for(
                lambda: all(batch_state(pg_dsn, schema, b.id) == ("complete", 0) for b in batches), what="the batches"
            )
            wait_for(lambda: sum(committed(kafka_bootstrap, acker.group, topic, 2)) == 181, what="every offset")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            if c.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [hidden]).fetchone():
                c.execute(f'ALTER SCHEMA "{hidden}" RENAME TO "{schema}"')
    assert acker.stats["polls"] >= 8  # 60 groups, 8 a round
    (letter,) = read_messages(kafka_bootstrap, dlq, 1)
    assert letter.value() == too_large and dict(letter.headers())["reason"].startswith(b"too large")
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 60
        assert invariant_violations(c, schema) == []


def test_a_round_that_fails_after_earlier_rounds_committed_loses_nothing(pg_dsn, schema, kafka_bootstrap, topics):
    """The third round of a poll fails once: the two before it stay committed, the rest of the
    poll (on both partitions) is read again, every batch completes once, every offset is committed."""
    from harvester.services.acker import Acker

    class FailingThirdRound(Acker):
        applies = 0

        def _apply(self, masks):
            FailingThirdRound.applies += 1
            if FailingThirdRound.applies == 3:
                raise psycopg.OperationalError("the database went away (injected)")
            return super()._apply(masks)

    topic, dlq = topics("acks", partitions=2), topics("dlq")
    batches, handles = _closed_batches(pg_dsn, schema, 40, 2)
    ids = [i for h in handles for i in h.item_ids]
    produce_raw(kafka_bootstrap, topic, [(str(n % 2).encode(), i.encode()) for n, i in enumerate(ids)])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, max_groups=6, retry_backoff=0.2)
    acker.__class__ = FailingThirdRound
    with running(acker):
        wait_for(lambda: all(batch_state(pg_dsn, schema, b.id) == ("complete", 0) for b in batches), what="batches")
        wait_for(lambda: sum(committed(kafka_bootstrap, acker.group, topic, 2)) == 80, what="every offset")
    assert FailingThirdRound.applies > 3 and acker.stats["retries"] == 1
    with psycopg.connect(pg_dsn) as c:
        assert len(completion_events(c, schema)) == 40
        assert invariant_violations(c, schema) == []


def test_a_failed_round_rewinds_every_partition_of_the_rest_of_the_poll():
    """Without Kafka: a poll whose second round (partition 0 only) fails must rewind partition 1
    too, whose messages were consumed with the poll but not yet folded."""
    from harvester.services.acker import Acker, Applied

    class Consumer:
        def __init__(self) -> None:
            self.seeks: dict[int, int] = {}

        def assignment(self):
            from confluent_kafka import TopicPartition

            return [TopicPartition("acks", 0), TopicPartition("acks", 1)]

        def seek(self, tp) -> None:
            self.seeks[tp.partition] = tp.offset

    acker = Acker(
        dsn="postgresql://unused",
        schema="s",
        bootstrap_servers="unused:1",
        topic="acks",
        group="g",
        dead_letter_topic="dlq",
        max_groups=2,
    )
    applied: list[set] = []

    def apply(steps):
        if len(applied) == 1:
            applied.append(set())
            raise psycopg.OperationalError("injected")
        applied.append({key for _reason, masks in steps for key in masks})
        return Applied()

    acker._apply = apply
    acker._dead_letter = lambda producer, folded, result: 0
    acker._commit = lambda consumer: None
    messages = [Msg(f"1:{g}:0".encode(), offset=10 + g, partition=0) for g in range(4)]
    messages += [Msg(f"2:{g}:0".encode(), offset=20 + g, partition=1) for g in range(3)]
    consumer = Consumer()
    assert acker._handle(consumer, None, messages) is False
    assert applied[0] == {(1, 0), (1, 1)}  # the first round was applied and stays so
    assert consumer.seeks == {0: 12, 1: 20}  # the failed round's first offset, and partition 1's
    assert acker.offsets.uncommitted == {0: 12}


def test_deferred_masks_count_against_the_bound_while_a_batch_stays_locked(pg_dsn, schema, kafka_bootstrap, topics):
    """Acks for a batch another transaction holds locked are deferred; they count against the
    fold's bound, so however many arrive, the acker holds at most about twice the bound."""
    from harvester.services.acker import Acker

    most = [0]

    class Watched(Acker):
        def _defer(self, result, first):
            super()._defer(result, first)
            most[0] = max(most[0], len(self._deferred))

    topic, dlq = topics("acks"), topics("dlq")
    with psycopg.connect(pg_dsn) as c:
        locked = tracker.open_batch(c, schema=schema)
        handles = [h for _ in range(30) for h in tracker.add_items(c, locked, 1, schema=schema)]
        other = tracker.open_batch(c, schema=schema)
        (other_handle,) = tracker.add_items(c, other, 5, schema=schema)
        c.commit()
    # 30 adds of one item: the first group takes them all, so name groups that do not exist too
    ids = [f"{locked.id}:{g}:0" for g in range(1, 60)] + [i for h in handles for i in h.item_ids]
    produce_raw(kafka_bootstrap, topic, [(b"k", i.encode()) for i in other_handle.item_ids + ids])
    holder = psycopg.connect(pg_dsn)
    holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR UPDATE', [locked.id])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq, max_groups=8, lock_timeout=0.5)
    acker.__class__ = Watched
    try:
        with running(acker):
            wait_for(lambda: acker._paused, what="the partitions paused while the deferred masks fill a fold")
            assert batch_state(pg_dsn, schema, other.id)[1] == 0  # acks before the bound was reached applied
            holder.rollback()
            wait_for(
                lambda: not acker._deferred and committed(kafka_bootstrap, acker.group, topic, 1) == [len(ids) + 5]
            )
    finally:
        holder.close()
    assert most[0] <= 2 * 8, most
    with psycopg.connect(pg_dsn) as c:
        assert batch_state(pg_dsn, schema, locked.id)[1] == 0
        assert invariant_violations(c, schema) == []


# ---------------------------------------------------------------- Spark's fold (no JVM needed)


@pytest.mark.parametrize("max_groups", [1, 7, 50])
def test_the_spark_fold_emits_at_most_max_groups_masks_at_a_time_and_they_add_up(max_groups):
    rows = [f"{i}:0:{i % 8192}" for i in range(300)] + [f"{i}:1:0-{i}" for i in range(120)]
    rows += [",".join(f"{i}:2:5" for i in range(j, j + 20)) for j in range(0, 200, 20)]
    batches = [pa.RecordBatch.from_pydict({"item_id": rows[k : k + 64]}) for k in range(0, len(rows), 64)]
    out = list(fold_arrow("item_id", max_groups=max_groups)(iter(batches)))
    assert len(out) >= (300 + 120 + 200) // (2 * max_groups)
    got: dict = {}
    for rb in out:
        groups = {(b, g) for b, g in zip(rb.column("batch_id").to_pylist(), rb.column("group_id").to_pylist())}
        assert len(groups) < 2 * max_groups  # the bound, and at most one slice past it
        for b, g, mask, n in zip(*(rb.column(c).to_pylist() for c in ("batch_id", "group_id", "mask", "folded"))):
            acc = got.setdefault((b, g), [0, 0])
            acc[0] |= int.from_bytes(mask.ljust(1024, b"\0"), "big")
            acc[1] += n
    expect = {
        k: [int.from_bytes(bytes(m.bits).ljust(1024, b"\0"), "big"), m.count]
        for k, m in fold(rows_entries(rows)).items()
    }
    assert got == expect


def rows_entries(rows: list[str]) -> list[str]:
    return [e for r in rows for e in r.split(",")]


def test_the_ack_producer_never_packs_more_groups_into_a_message_than_the_acker_folds(kafka_bootstrap, topics):
    """One batch of 20,000 groups acked at once, with messages allowed up to 1 MiB: the producer
    splits them so that no message is set aside by the acker as too large."""
    from tracker.consumer import AckProducer

    topic = topics("acks")
    producer = AckProducer(
        bootstrap_servers=kafka_bootstrap,
        topic=topic,
        kafka_client={"message.max.bytes": 2 << 20},  # a client that takes the 1 MiB messages asked for
        max_message_bytes=1 << 20,
        max_pending=10**6,
        linger=60,
    )
    producer.ack([f"7:{g}:0" for g in range(20_000)])
    producer.flush()
    messages = read_messages(kafka_bootstrap, topic, producer.messages_sent)
    groups = [len(m.value().split(b",")) for m in messages]
    assert sum(groups) == 20_000 and max(groups) <= GROUPS_PER_FOLD_MAX
    assert len(messages) == -(-20_000 // GROUPS_PER_FOLD_MAX)
    rest, folded_groups = messages, 0
    while rest:  # a full round per message: none is set aside
        folded = fold_messages(rest)
        assert not folded.bad and len(folded.masks) <= GROUPS_PER_FOLD_MAX
        folded_groups += len(folded.masks)
        rest = folded.rest
    assert folded_groups == 20_000


def test_the_spark_apply_commits_every_max_groups_masks(pg_dsn, schema, monkeypatch):
    """A partition given more groups than the bound applies them in several transactions, each
    holding at most the bound's masks (no JVM needed: the partition function runs in-process)."""
    import tracker.sync
    from tracker.spark.acks import _apply_partition

    batches, handles = _closed_batches(pg_dsn, schema, 10, 9)
    sizes: list[int] = []
    real = tracker.sync.apply_masks

    def counted(conn, masks, **kw):
        sizes.append(len(masks))
        return real(conn, masks, **kw)

    monkeypatch.setattr(tracker.sync, "apply_masks", counted)
    items = [((h.batch_id, h.group_id), (b"\xff\x80", 9)) for h in handles]
    (totals,) = list(_apply_partition(pg_dsn, schema, max_groups=3)(iter(items)))
    assert sizes == [3, 3, 3, 1] and totals["acked"] == 90 and sorted(totals["completed"]) == [b.id for b in batches]
    with psycopg.connect(pg_dsn) as c:
        assert invariant_violations(c, schema) == []
