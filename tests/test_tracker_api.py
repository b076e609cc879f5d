"""The tracker API against the real Postgres: flows, both session kinds, rollback, every error."""

from __future__ import annotations

import json

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from test_tracker_support import completion_events, invariant_violations, snapshot

import tracker
from tracker import outbox
from tracker.expiry import sweep
from tracker.ids import GROUP_BITS_MAX


@pytest.fixture
def engine(pg_dsn):
    eng = sa.create_engine(pg_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    yield eng
    eng.dispose()


def test_enqueue_writes_messages_groups_and_headers(conn, schema):
    batch = tracker.open_batch(conn, user_key="catalog-1", schema=schema)
    items = [
        b"raw",
        "text \u00e9",
        {"n": 1},
        [1, 2],
        None,
        tracker.Message(b"own", key="k1", headers={"trace": b"\x00\xff"}),
    ]
    handles = outbox.enqueue(conn, batch, items, topic="work", key=b"dflt", headers=[("src", "test")], schema=schema)
    assert [(h.batch_id, h.group_id, h.start, h.upto) for h in handles] == [(batch.id, 0, 0, 6)]
    ids = handles[0].item_ids
    assert ids == [f"{batch.id}:0:{i}" for i in range(6)]
    rows = conn.execute(
        f'SELECT topic, key, value, header_keys, header_values FROM "{schema}".outbox ORDER BY id'
    ).fetchall()
    bid = str(batch.id).encode()
    assert rows == [
        ("work", b"dflt", b"raw", ["item-id", "batch-id", "src"], [ids[0].encode(), bid, b"test"]),
        ("work", b"dflt", "text \u00e9".encode(), ["item-id", "batch-id", "src"], [ids[1].encode(), bid, b"test"]),
        ("work", b"dflt", b'{"n":1}', ["item-id", "batch-id", "src"], [ids[2].encode(), bid, b"test"]),
        ("work", b"dflt", b"[1,2]", ["item-id", "batch-id", "src"], [ids[3].encode(), bid, b"test"]),
        ("work", b"dflt", None, ["item-id", "batch-id", "src"], [ids[4].encode(), bid, b"test"]),
        ("work", b"k1", b"own", ["item-id", "batch-id", "src", "trace"], [ids[5].encode(), bid, b"test", b"\x00\xff"]),
    ]
    st = tracker.status(conn, batch, schema=schema)
    assert (st.state, st.total, st.pending, st.user_key) == ("open", 6, 6, "catalog-1")
    assert invariant_violations(conn, schema) == []


def test_key_function_and_large_adds_split_into_groups_of_8192(conn, schema):
    batch = tracker.open_batch(conn, schema=schema)
    n = 2 * GROUP_BITS_MAX + 5
    handles = outbox.enqueue(
        conn, batch, [str(i) for i in range(n)], topic="w", key=lambda v: "k" + v[-1], schema=schema
    )
    assert [(h.group_id, h.start, h.upto) for h in handles] == [(0, 0, 8192), (1, 0, 8192), (2, 0, 5)]
    sizes = conn.execute(
        f'SELECT id, size, pending, bit_count(bits) FROM "{schema}".batch_group ORDER BY id'
    ).fetchall()
    assert sizes == [(0, 8192, 8192, 8192), (1, 8192, 8192, 8192), (2, 5, 5, 5)]
    row = conn.execute(
        f'SELECT key, value, header_values[1] FROM "{schema}".outbox ORDER BY id OFFSET 8193 LIMIT 1'
    ).fetchone()
    assert row == (b"k3", b"8193", b"%d:1:1" % batch.id)
    # A later add first tops up the last group, then opens new ones.
    more = tracker.add_items(conn, batch, GROUP_BITS_MAX, schema=schema)
    assert [(h.group_id, h.start, h.upto) for h in more] == [(2, 5, 8192), (3, 0, 5)]
    assert more[0].item_ids[0] == f"{batch.id}:2:5" and len(more[0].item_ids) == 8187
    st = tracker.status(conn, batch, schema=schema)
    assert (st.total, st.pending) == (n + GROUP_BITS_MAX, n + GROUP_BITS_MAX)
    assert invariant_violations(conn, schema) == []


def test_ack_counts_duplicates_and_completes_exactly_once(conn, schema):
    batch = tracker.open_batch(conn, user_key="u1", completion_topic="done-here", schema=schema)
    (h,) = tracker.add_items(conn, batch, 10, schema=schema)
    r = tracker.ack(conn, [f"{batch.id}:0:1", f"{batch.id}:0:1", f"{batch.id}:0:2-4"], schema=schema)
    assert (r.acked, r.duplicates, r.completed) == (4, 1, [])
    assert tracker.close_batch(conn, batch, schema=schema) is False
    assert tracker.close_batch(conn, batch, schema=schema) is False  # idempotent
    r = tracker.ack(conn, h.item_ids, schema=schema)
    # acks are claims: the batch completes when they are settled (at commit, or by the close)
    assert (r.acked, r.duplicates, r.completed) == (6, 4, [])
    r = tracker.ack(conn, h.item_ids, schema=schema)  # re-ack: nothing new
    assert (r.acked, r.duplicates, r.completed) == (0, 10, [])
    assert tracker.close_batch(conn, batch, schema=schema) is True  # settles this transaction's claims
    r = tracker.ack(conn, h.item_ids, schema=schema)  # re-ack after completion: nothing new
    assert (r.acked, r.duplicates, r.completed) == (0, 10, [])
    conn.commit()
    assert tracker.status(conn, batch, schema=schema).state == "complete"
    events = completion_events(conn, schema, "done-here")
    assert len(events) == 1 and completion_events(conn, schema) == []
    key, value = events[0]
    st = tracker.status(conn, batch, schema=schema)
    assert key == str(batch.id).encode()
    body = json.loads(value)
    assert body["batch_id"] == batch.id and body["user_key"] == "u1" and body["total"] == 10
    assert {"opened_at", "closed_at", "completed_at"} <= body.keys()
    assert st.state == "complete" and st.pending == 0 and st.completed_at is not None
    assert invariant_violations(conn, schema) == []


def test_close_of_empty_or_fully_acked_batch_completes_at_close(conn, schema):
    empty = tracker.open_batch(conn, schema=schema)
    assert tracker.close_batch(conn, empty, schema=schema) is True
    acked = tracker.open_batch(conn, schema=schema)
    (h,) = tracker.add_items(conn, acked, 3, schema=schema)
    tracker.ack(conn, h.item_ids, schema=schema)
    assert tracker.status(conn, acked, schema=schema).state == "open"
    assert tracker.close_batch(conn, acked, schema=schema) is True
    assert [k for k, _ in completion_events(conn, schema)] == [str(empty.id).encode(), str(acked.id).encode()]


def test_sqlalchemy_session_commit_and_rollback(engine, schema):
    with Session(engine) as session:
        batch = tracker.open_batch(session, schema=schema)
        handles = outbox.enqueue(session, batch, [b"a", b"b"], topic="w", schema=schema)
        session.execute(sa.text("SELECT 1"))  # the caller's own work shares the transaction
        session.commit()
    with Session(engine) as session:
        r = tracker.ack(session, handles[0].item_ids, schema=schema)
        assert tracker.close_batch(session, batch, schema=schema) is True
        session.rollback()  # the caller changes its mind: nothing of the acks or close remains
        st = tracker.status(session, batch, schema=schema)
        assert (r.acked, st.state, st.pending) == (2, "open", 2)
        session.rollback()
    with Session(engine) as session, session.begin():
        tracker.ack(session, handles[0].item_ids, schema=schema)
        assert tracker.close_batch(session, batch, schema=schema) is True
    with engine.connect() as c:
        assert tracker.status(c, batch, schema=schema).state == "complete"
        assert c.execute(sa.text(f'SELECT count(*) FROM "{schema}".outbox')).scalar() == 3


def test_psycopg_rollback_leaves_nothing(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        before = snapshot(c, schema)
        c.commit()
        batch = tracker.open_batch(c, schema=schema)
        outbox.enqueue(c, batch, [b"x"] * 10, topic="w", schema=schema)
        tracker.ack(c, [f"{batch.id}:0:0-9"], schema=schema)
        tracker.close_batch(c, batch, schema=schema)
        c.rollback()
        assert snapshot(c, schema) == before


def test_autocommit_connection_commits_each_call(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        batch = tracker.open_batch(c, schema=schema)
        (h,) = tracker.add_items(c, batch, 2, schema=schema)
        with psycopg.connect(pg_dsn) as other:
            assert tracker.status(other, batch, schema=schema).pending == 2
        assert tracker.ack(c, [h.item_ids[0]], schema=schema).acked == 1
        before = snapshot(c, schema)
        with pytest.raises(tracker.IndexOutOfRange):
            tracker.ack(c, [h.item_ids[1], f"{batch.id}:0:2"], schema=schema)
        assert snapshot(c, schema) == before
        assert tracker.close_batch(c, batch, schema=schema) is False
        assert tracker.ack(c, h.item_ids, schema=schema).acked == 1  # completed by its commit
    with psycopg.connect(pg_dsn) as other:
        assert tracker.status(other, batch, schema=schema).state == "complete"


def test_two_trackers_in_one_process_do_not_interfere(pg_dsn, conn, schema):
    """Two Tracker objects (two schemas, two outbox tables' worth of config, two completion topics)
    in one process: each writes its events to its own outbox and topic, counts under its own label."""
    from prometheus_client import CollectorRegistry

    other_schema = f"{schema}_b"
    tracker.schema.migrate(pg_dsn, other_schema)
    try:
        registry = CollectorRegistry()
        first = tracker.Tracker(schema=schema, completion_topic="done-a", registry=registry)
        second = tracker.Tracker(schema=other_schema, completion_topic="done-b", registry=registry)
        a = first.open_batch(conn)
        b = second.open_batch(conn)
        first.add_items(conn, a, 3)
        first.ack(conn, [f"{a.id}:0:0-2"])  # claims: the close settles them and completes
        assert first.close_batch(conn, a) is True
        assert second.close_batch(conn, b) is True
        conn.commit()
        assert len(completion_events(conn, schema, "done-a")) == 1
        assert len(completion_events(conn, other_schema, "done-b")) == 1
        assert completion_events(conn, schema, "done-b") == [] and completion_events(conn, other_schema, "done-a") == []
        value = registry.get_sample_value
        assert value("reaper_batches_completed_total", {"schema": schema}) == 1
        assert value("reaper_batches_completed_total", {"schema": other_schema}) == 1
        assert value("reaper_acks_applied_total", {"schema": schema}) == 3
        assert value("reaper_acks_applied_total", {"schema": other_schema}) == 0
        assert not hasattr(tracker, "configure")  # no process-wide defaults to mutate
        with pytest.raises(tracker.InvalidIdentifier, match="no good"):
            tracker.Tracker(schema="no good")
    finally:
        conn.rollback()
        conn.execute(f'DROP SCHEMA "{other_schema}" CASCADE')
        conn.commit()


# ---------------------------------------------------------------- errors: each one changes nothing


@pytest.fixture
def populated(conn, schema):
    """Three batches (open with 20 items half acked, closed with 5, expired with 5), committed."""
    open_b = tracker.open_batch(conn, schema=schema)
    outbox.enqueue(conn, open_b, [b"v"] * 20, topic="w", schema=schema)
    tracker.ack(conn, [f"{open_b.id}:0:0-9"], schema=schema)
    closed_b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, closed_b, 5, schema=schema)
    tracker.close_batch(conn, closed_b, schema=schema)
    expired_b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, expired_b, 5, schema=schema)
    conn.execute(
        f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '2 hours' WHERE id = %s", [expired_b.id]
    )
    conn.commit()
    assert sweep(conn, schema=schema, idle_expiry=3600, retention=86400).expired == 1
    conn.commit()
    return open_b, closed_b, expired_b


def _unchanged_after(conn, schema, call, error, match):
    before = snapshot(conn, schema)
    conn.execute("SELECT 1")  # the caller's transaction is open
    with pytest.raises(error, match=match):
        call()
    # The caller's transaction is still usable and the failed call left nothing, even on commit.
    conn.execute("SELECT 1")
    conn.commit()
    assert snapshot(conn, schema) == before
    assert invariant_violations(conn, schema) == []


def test_malformed_id_changes_nothing(conn, schema, populated):
    open_b = populated[0]
    for bad in [
        f"{open_b.id}:0",
        f"{open_b.id}:0:x",
        f"{open_b.id}:0:-1",
        "a:b:c",
        f"{open_b.id}:0:5-2",
        f"{open_b.id}:0:\u0661",
        f"{open_b.id}:0: 3",
        b"\xff:0:1",
        17,
    ]:
        _unchanged_after(
            conn,
            schema,
            lambda: tracker.ack(conn, [f"{open_b.id}:0:10", bad], schema=schema),
            tracker.MalformedItemId,
            "malformed item id",
        )


def test_ids_past_a_bigint_or_any_group_change_nothing(conn, schema, populated):
    open_b = populated[0]
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:10", "9223372036854775808:0:0"], schema=schema),
        tracker.MalformedItemId,
        "9223372036854775808:0:0",
    )
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:10", f"{open_b.id}:0:99999999999999"], schema=schema),
        tracker.IndexOutOfRange,
        "99999999999999",
    )


def test_unknown_batch_changes_nothing(conn, schema, populated):
    open_b = populated[0]
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:11", "999999:0:1"], schema=schema),
        tracker.UnknownBatch,
        "unknown batch 999999.*999999:0:1",
    )
    _unchanged_after(
        conn, schema, lambda: tracker.close_batch(conn, 999999, schema=schema), tracker.UnknownBatch, "999999"
    )
    _unchanged_after(
        conn, schema, lambda: tracker.add_items(conn, 999999, 1, schema=schema), tracker.UnknownBatch, "999999"
    )


def test_unknown_group_changes_nothing(conn, schema, populated):
    open_b = populated[0]
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:12", f"{open_b.id}:7:3"], schema=schema),
        tracker.UnknownGroup,
        f"unknown group 7 in batch {open_b.id}.*'{open_b.id}:7:3'",
    )


def test_index_out_of_range_changes_nothing(conn, schema, populated):
    open_b = populated[0]
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:13", f"{open_b.id}:0:20"], schema=schema),
        tracker.IndexOutOfRange,
        f"'{open_b.id}:0:20' is out of range: its group has 20 items",
    )
    # a run past the group's end is named as written, not by its first bad index
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:15-8191"], schema=schema),
        tracker.IndexOutOfRange,
        f"'{open_b.id}:0:15-8191'",
    )


@pytest.mark.parametrize("which,state", [(1, "closed"), (2, "expired"), ("complete", "complete")])
def test_add_to_a_batch_that_is_not_open_changes_nothing(conn, schema, populated, which, state):
    if which == "complete":
        batch = tracker.open_batch(conn, schema=schema)
        tracker.close_batch(conn, batch, schema=schema)
        conn.commit()
    else:
        batch = populated[which]
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.add_items(conn, batch, 3, schema=schema),
        tracker.BatchNotOpen,
        f"batch {batch.id} is {state}",
    )
    _unchanged_after(
        conn,
        schema,
        lambda: outbox.enqueue(conn, batch, [b"a"] * 3, topic="w", schema=schema),
        tracker.BatchNotOpen,
        f"batch {batch.id} is {state}",
    )


def test_ack_of_expired_batch_changes_nothing(conn, schema, populated):
    open_b, _, expired_b = populated
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.ack(conn, [f"{open_b.id}:0:14", f"{expired_b.id}:0:1"], schema=schema),
        tracker.BatchExpired,
        f"batch {expired_b.id} has expired.*'{expired_b.id}:0:1'",
    )
    _unchanged_after(
        conn,
        schema,
        lambda: tracker.close_batch(conn, expired_b, schema=schema),
        tracker.BatchExpired,
        str(expired_b.id),
    )


def test_database_error_mid_enqueue_leaves_caller_transaction_usable(conn, schema):
    batch = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, batch, 3, schema=schema)
    # A CHECK the COPY trips after the batch row and groups were written: all of the call must go.
    conn.execute(f"ALTER TABLE \"{schema}\".outbox ADD CONSTRAINT no_bad CHECK (value <> 'bad') NOT VALID")
    conn.commit()
    before = snapshot(conn, schema)
    conn.execute("SELECT 1")
    with pytest.raises(psycopg.errors.CheckViolation):
        outbox.enqueue(conn, batch, [b"ok"] * 8192 + [b"bad"], topic="w", schema=schema)
    conn.execute("SELECT 1")
    conn.commit()
    assert snapshot(conn, schema) == before


def test_apply_masks_reject_invalid_applies_the_valid_rest(conn, schema, populated):
    open_b, closed_b, expired_b = populated
    masks = tracker.fold(
        [f"{open_b.id}:0:10-25", f"{closed_b.id}:0:0-4", f"{closed_b.id}:3:1", f"{expired_b.id}:0:2", "999999:0:0-1"]
    )
    r = tracker.apply_masks(conn, masks, schema=schema, reject_invalid=True)
    assert (r.acked, r.duplicates, r.completed) == (15, 0, [closed_b.id])
    assert sorted(r.rejected) == sorted(
        [
            (f"{open_b.id}:0:20-25", "index out of range (group size 20)"),
            (f"{closed_b.id}:3:1", "unknown group"),
            (f"{expired_b.id}:0:2", "batch expired"),
            ("999999:0:0-1", "unknown batch"),
        ]
    )
    assert tracker.status(conn, open_b, schema=schema).pending == 0
    assert invariant_violations(conn, schema) == []


def test_sweeper_expires_idle_and_deletes_old_in_chunks(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        fresh = tracker.open_batch(c, schema=schema)
        idle = [tracker.open_batch(c, schema=schema) for _ in range(5)]
        closed_idle = tracker.open_batch(c, schema=schema)
        tracker.add_items(c, closed_idle, 3, schema=schema)
        tracker.close_batch(c, closed_idle, schema=schema)
        done = [tracker.open_batch(c, schema=schema) for _ in range(4)]
        for b in done:
            tracker.add_items(c, b, 2, schema=schema)
            tracker.close_batch(c, b, schema=schema)
            tracker.ack(c, [f"{b.id}:0:0-1"], schema=schema)
        s = f'"{schema}"'
        c.execute(
            f"UPDATE {s}.batch SET last_activity_at = now() - interval '2 hours' WHERE id = ANY(%s)",
            [[b.id for b in idle] + [closed_idle.id]],
        )
        c.execute(
            f"UPDATE {s}.batch SET completed_at = now() - interval '3 days' WHERE id = ANY(%s)",
            [[b.id for b in done[:3]]],
        )
        r = sweep(c, schema=schema, idle_expiry=3600, retention=86400, chunk=2)
        assert (r.expired, r.deleted) == (6, 3)
        states = dict(c.execute(f"SELECT id, state FROM {s}.batch").fetchall())
        assert states == {
            fresh.id: "open",
            done[3].id: "complete",
            **{b.id: "expired" for b in idle},
            closed_idle.id: "expired",
        }
        assert (
            c.execute(
                f"SELECT count(*) FROM {s}.batch_group WHERE batch_id = ANY(%s)", [[b.id for b in done[:3]]]
            ).fetchone()[0]
            == 0
        )
        # A sweep with nothing to do does nothing; expired batches go after their retention.
        assert sweep(c, schema=schema, idle_expiry=3600, retention=86400, chunk=2) == type(r)(0, 0)
        assert sweep(c, schema=schema, idle_expiry=3600, retention=0, chunk=2).deleted == 7


def test_sweeper_skips_a_batch_held_by_a_transaction(pg_dsn, schema):
    with psycopg.connect(pg_dsn, autocommit=True) as c, psycopg.connect(pg_dsn) as app:
        b = tracker.open_batch(c, schema=schema)
        c.execute(f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '2 hours'")
        tracker.add_items(app, b, 1, schema=schema)  # holds the batch row, uncommitted
        assert sweep(c, schema=schema, idle_expiry=3600, retention=0).expired == 0
        app.commit()
        assert sweep(c, schema=schema, idle_expiry=3600, retention=0).expired == 0  # the add was activity
        assert tracker.status(c, b, schema=schema).state == "open"


def test_concurrent_sweepers_share_the_work(pg_dsn, schema):
    import threading

    with psycopg.connect(pg_dsn, autocommit=True) as c:
        ids = [tracker.open_batch(c, schema=schema).id for _ in range(300)]
        c.execute(f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '2 hours'")
    results, errors = [], []

    def run():
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as own:
                results.append(sweep(own, schema=schema, idle_expiry=3600, retention=0, chunk=7))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    # Every batch expired exactly once and then deleted exactly once, whichever sweeper got it.
    assert sum(r.expired for r in results) == 300
    with psycopg.connect(pg_dsn) as c:
        left = c.execute(f'SELECT count(*) FROM "{schema}".batch WHERE id = ANY(%s)', [ids]).fetchone()[0]
    assert sum(r.deleted for r in results) + left == 300


def test_sweeper_commits_chunks_only_on_an_idle_connection(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        for _ in range(3):
            tracker.open_batch(c, schema=schema)
        c.execute(f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '2 hours'")
        c.commit()
        c.execute("SELECT 1")  # the caller's transaction: sweep leaves it to the caller
        assert sweep(c, schema=schema, idle_expiry=3600, retention=86400, chunk=2).expired == 3
        c.rollback()
        assert sweep(c, schema=schema, idle_expiry=3600, retention=86400, chunk=2).expired == 3  # idle: commits
        c.rollback()
        states = c.execute(f'SELECT DISTINCT state FROM "{schema}".batch').fetchall()
        assert states == [("expired",)]
