"""Expiry is an event: the sweeper (and `expire_batch`) write exactly one expiry event per batch
through the outbox, in the statement that expires it, even with several sweepers racing."""

from __future__ import annotations

import json
import threading

import psycopg
import pytest
from prometheus_client import CollectorRegistry

import tracker
from tracker import outbox
from tracker.errors import BatchExpired, UnknownBatch
from tracker.expiry import EXPIRY_EVENT, BatchNotExpirable, expire_batch, sweep


def _age(conn, schema: str, ids: list[int], hours: int = 2) -> None:
    conn.execute(
        f'UPDATE "{schema}".batch SET last_activity_at = now() - make_interval(hours => %s) WHERE id = ANY(%s)',
        [hours, ids],
    )
    conn.commit()


def events(conn, schema: str) -> list[dict]:
    """Every expiry event in the outbox: topic, key, value (parsed) and headers."""
    rows = conn.execute(
        f'SELECT topic, key, value, header_keys, header_values FROM "{schema}".outbox '
        "WHERE 'event' = ANY(header_keys) ORDER BY id"
    ).fetchall()
    conn.commit()
    return [
        {
            "topic": t,
            "key": bytes(k).decode(),
            "value": json.loads(bytes(v)),
            "headers": dict(zip(hk, (bytes(x).decode() for x in hv))),
        }
        for t, k, v, hk, hv in rows
    ]


def test_sweeper_writes_one_event_per_expired_batch_with_user_key_counts_and_reason(conn, schema):
    a = tracker.open_batch(conn, user_key="catalog-1", schema=schema)  # default topic, open, half acked
    outbox.enqueue(conn, a, [b"x"] * 10, topic="work", schema=schema)
    tracker.ack(conn, [f"{a.id}:0:0-4"], schema=schema)
    b = tracker.open_batch(conn, user_key=None, completion_topic="done-b", schema=schema)  # closed, 3 pending
    tracker.add_items(conn, b, 3, schema=schema)
    tracker.close_batch(conn, b, schema=schema)
    fresh = tracker.open_batch(conn, user_key="fresh", schema=schema)  # active: not expired
    conn.commit()
    _age(conn, schema, [a.id, b.id])
    conn.execute(
        f'UPDATE "{schema}".batch SET traceparent = %s WHERE id = %s',
        ["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", b.id],
    )
    conn.commit()

    result = sweep(conn, schema=schema, idle_expiry=3600, retention=86400, completion_topic="completions")
    assert result.expired == 2
    got = {e["value"]["batch_id"]: e for e in events(conn, schema)}
    assert set(got) == {a.id, b.id}
    ea, eb = got[a.id], got[b.id]
    assert ea["topic"] == "completions" and eb["topic"] == "done-b"
    assert ea["key"] == str(a.id)
    assert ea["headers"] == {"batch-id": str(a.id), "event": EXPIRY_EVENT}
    assert eb["headers"]["traceparent"] == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    va, vb = ea["value"], eb["value"]
    assert (va["event"], va["user_key"], va["total"], va["pending"], va["acked"], va["state"], va["reason"]) == (
        "expired",
        "catalog-1",
        10,
        5,
        5,
        "open",
        "idle",
    )
    assert va["idle_expiry_seconds"] == 3600 and va["closed_at"] is None and va["expired_at"]
    assert (vb["user_key"], vb["total"], vb["pending"], vb["acked"], vb["state"]) == (None, 3, 3, 0, "closed")
    assert vb["closed_at"] is not None
    assert tracker.status(conn, fresh, schema=schema).state == "open"
    # A second sweep finds nothing more and writes nothing more.
    assert sweep(conn, schema=schema, idle_expiry=3600, retention=86400).expired == 0
    assert len(events(conn, schema)) == 2


def test_expiry_topic_overrides_every_batch_topic(conn, schema):
    ids = [tracker.open_batch(conn, completion_topic=t, schema=schema).id for t in ("x", None)]
    conn.commit()
    _age(conn, schema, ids)
    sweep(conn, schema=schema, idle_expiry=60, retention=86400, expiry_topic="expiries")
    assert [e["topic"] for e in events(conn, schema)] == ["expiries", "expiries"]


@pytest.mark.parametrize("sweepers,chunk", [(2, 1), (4, 3), (6, 17)])
def test_concurrent_sweepers_and_an_operator_expire_and_announce_each_batch_exactly_once(
    pg_dsn, conn, schema, sweepers, chunk
):
    ids = [tracker.open_batch(conn, user_key=f"k{i}", schema=schema).id for i in range(60)]
    conn.commit()
    _age(conn, schema, ids)
    counts: list[int] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(pg_dsn) as c:
                start.wait()
                counts.append(sweep(c, schema=schema, idle_expiry=60, retention=86400, chunk=chunk).expired)
        except BaseException as exc:
            errors.append(exc)

    by_operator: list[int] = []

    def operator() -> None:  # `reaper batch expire` racing the sweepers, batch by batch
        try:
            with psycopg.connect(pg_dsn, autocommit=True) as c:
                start.wait()
                for bid in reversed(ids):
                    if expire_batch(c, bid, schema=schema) is not None:
                        by_operator.append(bid)
        except BaseException as exc:
            errors.append(exc)

    start = threading.Barrier(sweepers + 1)
    threads = [threading.Thread(target=run) for _ in range(sweepers)] + [threading.Thread(target=operator)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sum(counts) + len(by_operator) == 60, (counts, by_operator)
    got = [e["value"]["batch_id"] for e in events(conn, schema)]
    assert sorted(got) == sorted(ids), "each expired batch must be announced exactly once"
    states = conn.execute(f'SELECT state, count(*) FROM "{schema}".batch GROUP BY state').fetchall()
    assert states == [("expired", 60)]


def test_last_ack_racing_the_sweeper_gives_completion_or_expiry_never_both(pg_dsn, conn, schema):
    batches = []
    for _ in range(30):
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 1, schema=schema)
        tracker.close_batch(conn, b, schema=schema)
        batches.append(b.id)
    conn.commit()
    _age(conn, schema, batches)
    go = threading.Barrier(2)
    outcome: dict[int, str] = {}

    def acker() -> None:
        with psycopg.connect(pg_dsn) as c:
            go.wait()
            for bid in batches:
                try:
                    r = tracker.ack(c, [f"{bid}:0:0"], schema=schema)
                    c.commit()
                    if r.completed:
                        outcome[bid] = "complete"
                except BatchExpired:
                    c.rollback()

    def sweeper() -> None:
        with psycopg.connect(pg_dsn) as c:
            go.wait()
            for _ in range(30):
                sweep(c, schema=schema, idle_expiry=60, retention=86400, chunk=1, max_chunks=1)

    threads = [threading.Thread(target=acker), threading.Thread(target=sweeper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    sweep(conn, schema=schema, idle_expiry=60, retention=86400)  # whatever is left and idle
    conn.commit()
    rows = conn.execute(f'SELECT topic, header_keys, value FROM "{schema}".outbox ORDER BY id').fetchall()
    per_batch: dict[int, list[str]] = {}
    for _topic, keys, value in rows:
        v = json.loads(bytes(value))
        per_batch.setdefault(v["batch_id"], []).append("expired" if "event" in keys else "complete")
    states = dict(conn.execute(f'SELECT id, state FROM "{schema}".batch').fetchall())
    for bid in batches:
        assert per_batch.get(bid) == [states[bid]], (bid, per_batch.get(bid), states[bid])
        if outcome.get(bid) == "complete":
            assert states[bid] == "complete"


def test_expire_batch_writes_the_same_event_or_changes_nothing(conn, schema):
    b = tracker.open_batch(conn, user_key="by-hand", completion_topic="done", schema=schema)
    tracker.add_items(conn, b, 4, schema=schema)
    done = tracker.open_batch(conn, schema=schema)
    tracker.close_batch(conn, done, schema=schema)  # empty: complete at once
    conn.commit()
    before = conn.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0]
    for bad, error in ((done.id, BatchNotExpirable), (10**9, UnknownBatch)):
        with pytest.raises(error, match=str(bad)):
            expire_batch(conn, bad, schema=schema)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS  # usable, still open
        conn.rollback()
    assert conn.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0] == before
    conn.rollback()

    got = expire_batch(conn, b.id, schema=schema, note="stuck consumer")
    assert (got.batch_id, got.user_key, got.total, got.pending, got.topic) == (b.id, "by-hand", 4, 4, "done")
    conn.rollback()  # the caller's rollback undoes the expiry and its event
    assert tracker.status(conn, b, schema=schema).state == "open" and events(conn, schema) == []

    expire_batch(conn, b.id, schema=schema, note="stuck consumer")
    conn.commit()
    assert expire_batch(conn, b.id, schema=schema) is None  # already expired: nothing new
    conn.commit()
    [e] = events(conn, schema)
    assert (e["topic"], e["value"]["reason"], e["value"]["note"], e["value"]["pending"]) == (
        "done",
        "operator",
        "stuck consumer",
        4,
    )
    with pytest.raises(BatchExpired):
        tracker.ack(conn, [f"{b.id}:0:0"], schema=schema)
    conn.rollback()


def test_bad_arguments_are_refused_before_anything_runs(conn, schema):
    for kwargs, match in (({"expiry_topic": ""}, "expiry_topic"), ({"outbox_table": "x;y"}, "outbox table")):
        with pytest.raises(ValueError, match=match):
            sweep(conn, schema=schema, idle_expiry=1, retention=1, **kwargs)
    with pytest.raises(ValueError, match="batch id"):
        expire_batch(conn, -1, schema=schema)


def _sweep_failing_at_its_deletes(conn, schema: str) -> list[int]:
    """Two idle batches to expire, then a delete that fails (a trigger refuses it): the sweep fails
    after its expiry chunk. Returns the idle batches' ids."""
    idle = [tracker.open_batch(conn, schema=schema).id for _ in range(2)]
    done = tracker.open_batch(conn, schema=schema)
    tracker.close_batch(conn, done, schema=schema)  # no items: complete at once
    conn.commit()
    _age(conn, schema, idle)
    conn.execute(f"UPDATE \"{schema}\".batch SET completed_at = now() - interval '2 days' WHERE id = %s", [done.id])
    conn.execute(
        f"""CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN RAISE EXCEPTION 'deletes refused here'; END $$"""
    )
    conn.execute(
        f'CREATE TRIGGER refuse BEFORE DELETE ON "{schema}".batch FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse()'
    )
    conn.execute(f'CREATE TABLE "{schema}".mine (x int)')
    conn.commit()
    return idle


def _expired_counted(registry: CollectorRegistry, schema: str) -> float:
    return registry.get_sample_value("reaper_batches_expired_total", {"schema": schema}) or 0.0


def _states(conn, schema: str, ids: list[int]) -> list[str]:
    return [r[0] for r in conn.execute(f'SELECT state FROM "{schema}".batch WHERE id = ANY(%s) ORDER BY id', [ids])]


def test_a_failed_sweep_in_the_callers_transaction_undoes_itself_alone(conn, schema):
    idle = _sweep_failing_at_its_deletes(conn, schema)
    conn.execute(f'INSERT INTO "{schema}".mine VALUES (1)')  # the caller's own work, not committed
    registry = CollectorRegistry()
    with pytest.raises(psycopg.errors.RaiseException, match="deletes refused"):
        sweep(conn, schema=schema, idle_expiry=60, retention=60, registry=registry)
    assert _expired_counted(registry, schema) == 0  # undone, so not counted
    # usable, with the caller's row in it and nothing of the sweep (its expiries were undone)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert conn.execute(f'SELECT count(*) FROM "{schema}".mine').fetchone() == (1,)
    assert _states(conn, schema, idle) == ["open", "open"]
    conn.commit()
    assert events(conn, schema) == []
    assert conn.execute(f'SELECT count(*) FROM "{schema}".mine').fetchone() == (1,)


def test_a_failed_sweep_on_an_idle_connection_keeps_its_committed_chunks_and_leaves_it_idle(conn, schema):
    idle = _sweep_failing_at_its_deletes(conn, schema)
    registry = CollectorRegistry()
    with pytest.raises(psycopg.errors.RaiseException, match="deletes refused"):
        sweep(conn, schema=schema, idle_expiry=60, retention=60, registry=registry)
    assert _expired_counted(registry, schema) == 2  # committed, so counted
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert _states(conn, schema, idle) == ["expired", "expired"]  # committed chunk by chunk
    assert len(events(conn, schema)) == 2
