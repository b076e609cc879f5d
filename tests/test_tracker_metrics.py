"""The tracker's Prometheus metrics: names under its prefix, the lifecycle counters, and batches
finished by a failure counted as completed, sync and async."""

from __future__ import annotations

import psycopg
import pytest

import tracker
from tracker.expiry import sweep


def test_a_tracker_names_its_metrics_with_its_prefix(conn, schema):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    default = tracker.Tracker(schema=schema, registry=registry)
    mine = tracker.Tracker(schema=schema, registry=registry, metrics_prefix="billing")
    default.open_batch(conn)
    b = mine.open_batch(conn)
    mine.add_items(conn, b, 2)
    mine.ack(conn, [f"{b.id}:0:0-1"])
    mine.close_batch(conn, b)
    conn.rollback()
    value = registry.get_sample_value
    assert value("reaper_batches_opened_total", {"schema": schema}) == 1
    assert value("billing_batches_opened_total", {"schema": schema}) == 1
    assert value("billing_batches_closed_total", {"schema": schema}) == 1
    assert value("billing_acks_applied_total", {"schema": schema}) == 2
    assert value("reaper_acks_applied_total", {"schema": schema}) == 0
    for bad in ("9lives", "no-dash", ""):
        with pytest.raises(tracker.InvalidValue, match=repr(bad)):
            tracker.Tracker(schema=schema, registry=registry, metrics_prefix=bad)
    with pytest.raises(tracker.InvalidArgument, match="metrics_prefix"):
        tracker.Tracker(schema=schema, registry=registry, metrics_prefix=None)


def test_lifecycle_metrics_count(conn, schema):
    from prometheus_client import REGISTRY

    def value(name):  # the tracker's collectors are labelled by schema
        return REGISTRY.get_sample_value(name, {"schema": schema}) or 0.0

    names = [
        "reaper_batches_opened_total",
        "reaper_batches_closed_total",
        "reaper_batches_completed_total",
        "reaper_batches_expired_total",
        "reaper_acks_applied_total",
        "reaper_acks_duplicate_total",
    ]
    before = {n: value(n) for n in names}
    b = tracker.open_batch(conn, schema=schema)
    tracker.add_items(conn, b, 3, schema=schema)
    tracker.ack(conn, [f"{b.id}:0:0-2", f"{b.id}:0:1"], schema=schema)
    tracker.close_batch(conn, b, schema=schema)  # settles the acks' claims: this process completes it
    idle = tracker.open_batch(conn, schema=schema)
    conn.execute(
        f"UPDATE \"{schema}\".batch SET last_activity_at = now() - interval '2 hours' WHERE id = %s", [idle.id]
    )
    sweep(conn, schema=schema, idle_expiry=3600, retention=86400)
    delta = {n: value(n) - before[n] for n in names}
    assert delta == {
        "reaper_batches_opened_total": 2,
        "reaper_batches_closed_total": 1,
        "reaper_batches_completed_total": 1,
        "reaper_batches_expired_total": 1,
        "reaper_acks_applied_total": 3,
        "reaper_acks_duplicate_total": 1,
    }


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_batch_finished_by_a_failure_counts_as_completed(pg_dsn, conn, schema, side):
    """Its last item failed, or a failure past its threshold: a completion event is written, and
    reaper_batches_completed_total counts it as an ack that completes one would."""
    import asyncio

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    sync_side = tracker.Tracker(schema=schema, registry=registry)
    last = sync_side.open_batch(conn)
    sync_side.add_items(conn, last, 2)
    sync_side.close_batch(conn, last)
    early = sync_side.open_batch(conn, tolerated_failures=0)
    sync_side.add_items(conn, early, 3)
    sync_side.close_batch(conn, early)
    masked = sync_side.open_batch(conn)
    sync_side.add_items(conn, masked, 1)
    sync_side.close_batch(conn, masked)
    sync_side.ack(conn, [f"{last.id}:0:0"], claims=False)
    conn.commit()
    value = registry.get_sample_value
    before = value("reaper_batches_completed_total", {"schema": schema}) or 0
    if side == "sync":
        assert sync_side.fail(conn, [f"{last.id}:0:1"], "gave up").completed == [last.id]
        assert sync_side.fail(conn, [f"{early.id}:0:0"], "gave up").completed == [early.id]
        assert sync_side.fail_masks(conn, tracker.fold([f"{masked.id}:0:0"]), "gave up").completed == [masked.id]
        conn.commit()
    else:

        async def run() -> None:
            aio_side = tracker.AsyncTracker(schema=schema, registry=registry)
            async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
                assert (await aio_side.fail(aconn, [f"{last.id}:0:1"], "gave up")).completed == [last.id]
                assert (await aio_side.fail(aconn, [f"{early.id}:0:0"], "gave up")).completed == [early.id]
                done = await aio_side.fail_masks(aconn, tracker.fold([f"{masked.id}:0:0"]), "gave up")
                assert done.completed == [masked.id]
                await aconn.commit()

        asyncio.run(run())
    assert value("reaper_batches_completed_total", {"schema": schema}) == before + 3
