"""Review fixes on the claim side: expiry settles committed acks first, an ack in flight at an expiry changes nothing after it, claims
never change an expired batch's counts, and a settle round reaches past busy batches."""

from __future__ import annotations

import json

import psycopg
import pytest
from support.acking import closed_batch

import tracker
from tracker import expiry
from tracker.settle import settle


def _quiet(pg_dsn: str, schema: str, n: int):
    """A closed batch of n items, idle for 10 minutes, and their ids."""
    b, (h,) = closed_batch(pg_dsn, schema, n)
    with psycopg.connect(pg_dsn) as c:
        c.execute(
            f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '10 minutes' WHERE id = %s", [b.id]
        )
    return b, list(h.item_ids)


def _row(pg_dsn: str, schema: str, batch_id: int) -> tuple:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT state, pending FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()


def _events(pg_dsn: str, schema: str) -> list[dict]:
    with psycopg.connect(pg_dsn) as c:
        return [json.loads(v) for (v,) in c.execute(f'SELECT value FROM "{schema}".outbox ORDER BY id')]


def _sweep(pg_dsn: str, schema: str) -> expiry.SweepResult:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        return expiry.sweep(c, schema=schema, idle_expiry=300, retention=86400, registry=None)


def test_the_sweeper_settles_committed_claims_before_expiring(pg_dsn, schema):
    b, ids = _quiet(pg_dsn, schema, 3)
    with psycopg.connect(pg_dsn) as c:  # REPEATABLE READ: committed as claims, not settled at commit
        c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        assert tracker.ack(c, ids, schema=schema).acked == 3
    res = _sweep(pg_dsn, schema)
    assert (res.expired, res.completed) == (0, 1)
    assert _row(pg_dsn, schema, b.id) == ("complete", 0)
    assert [e["event"] for e in _events(pg_dsn, schema)] == ["batch.completed"]


@pytest.mark.parametrize("isolation", ["READ_COMMITTED", "REPEATABLE_READ"])
def test_an_ack_in_flight_when_its_batch_expires_changes_nothing_after_its_event(pg_dsn, schema, isolation):
    """Claims lock no batch row (consumers of a batch never wait on each other, nor on the sweeper),
    so an expiry does not wait for a claim in flight. The claim, committed after the expiry, is
    dropped: the batch keeps the counts its one expiry event told; a later ack is refused."""
    b, ids = _quiet(pg_dsn, schema, 2)
    with psycopg.connect(pg_dsn) as consumer:
        consumer.isolation_level = getattr(psycopg.IsolationLevel, isolation)
        assert tracker.exactly_once(consumer, ids[0], lambda s: "effect", schema=schema).first_time
        assert _sweep(pg_dsn, schema).expired == 1  # not blocked by the claim in flight
        consumer.commit()
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        settle(c, schema=schema, registry=None)
        assert c.execute(f'SELECT count(*) FROM "{schema}".ack_claim').fetchone() == (0,)
        with pytest.raises(tracker.BatchExpired):
            tracker.ack(c, ids, schema=schema)
    assert _row(pg_dsn, schema, b.id) == ("expired", 2)
    (event,) = _events(pg_dsn, schema)
    assert (event["event"], event["pending"]) == ("expired", 2)


def test_a_claim_never_changes_an_expired_batchs_counts(pg_dsn, schema):
    b, ids = _quiet(pg_dsn, schema, 2)
    with psycopg.connect(pg_dsn) as consumer:
        consumer.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        consumer.execute("SELECT 1")  # its snapshot predates the expiry: it still sees the batch closed
        assert _sweep(pg_dsn, schema).expired == 1
        tracker.ack(consumer, ids, schema=schema)  # claimed against the old snapshot
        consumer.commit()
        with pytest.raises(tracker.BatchExpired):  # a new snapshot sees the expiry
            tracker.ack(consumer, ids, schema=schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # its committed claims reach the expired batch
        assert c.execute(f'SELECT count(*) FROM "{schema}".ack_claim').fetchone() == (2,)
        assert settle(c, schema=schema, registry=None).acked == 0
        assert c.execute(f'SELECT count(*) FROM "{schema}".ack_claim').fetchone() == (0,)
    assert _row(pg_dsn, schema, b.id) == ("expired", 2)  # as its expiry event said
    (event,) = _events(pg_dsn, schema)
    assert (event["event"], event["pending"]) == ("expired", 2)


def test_a_settle_round_reaches_past_busy_batches(pg_dsn, schema):
    (b1, (h1,)), (b2, (h2,)) = closed_batch(pg_dsn, schema, 1), closed_batch(pg_dsn, schema, 1)
    with psycopg.connect(pg_dsn) as holder:
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = ANY(%s) FOR NO KEY UPDATE', [[b1.id, b2.id]])
        for h in (h1, h2):  # the commit-time settle finds the rows busy: the claims stay
            with psycopg.connect(pg_dsn) as c:
                tracker.ack(c, h.item_ids, schema=schema)
        holder.rollback()
        holder.execute(f'SELECT 1 FROM "{schema}".batch WHERE id = %s FOR NO KEY UPDATE', [b1.id])
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            r = settle(c, schema=schema, limit=1, registry=None)
        assert (r.completed, r.busy) == ([b2.id], [b1.id])
    assert _row(pg_dsn, schema, b2.id) == ("complete", 0)
