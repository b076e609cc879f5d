"""Issue 12: the reaper's acker never stalls behind an application transaction.

A producer holds one batch's row (an add in an open transaction) while the acker receives acks for
that batch and for others in the same partitions. The others are applied at once; the held
batch's masks are deferred (metric + log), the partitions' offsets stay at or before the
deferring poll, and when the producer commits the deferred acks land: nothing lost, nothing
counted twice, exactly one completion per batch.
"""

from __future__ import annotations

import random

import psycopg
from prometheus_client import REGISTRY
from support.acking import batch_state, committed, end_offsets, make_acker, running
from support.harness import wait_for
from test_tracker_support import completion_events, invariant_violations

import tracker
from tracker.consumer import AckProducer


def test_acker_defers_a_locked_batch_and_applies_the_rest(pg_dsn, schema, kafka_bootstrap, topics):
    topic, dlq = topics("acks", partitions=2), topics("dlq")
    rng = random.Random()
    with psycopg.connect(pg_dsn) as c:
        batches = []
        for n in (9000, 300, 50):
            b = tracker.open_batch(c, schema=schema)
            handles = tracker.add_items(c, b, n, schema=schema)
            batches.append((b, [i for h in handles for i in h.item_ids]))
        tracker.close_batch(c, batches[1][0], schema=schema)
        tracker.close_batch(c, batches[2][0], schema=schema)
        c.commit()
    held_batch, held_ids = batches[0]
    deferred_before = REGISTRY.get_sample_value("reaper_acker_deferred_total", {"schema": schema}) or 0.0
    with psycopg.connect(pg_dsn) as producer:
        # The application transaction: one more item in the held batch, not committed yet.
        (extra,) = tracker.add_items(producer, held_batch, 1, schema=schema)
        with AckProducer(bootstrap_servers=kafka_bootstrap, topic=topic, max_pending=500) as acks:
            everything = [i for _b, ids in batches for i in ids]
            rng.shuffle(everything)
            acks.ack(everything + everything[:200])  # some twice
        acker = make_acker(pg_dsn, schema, kafka_bootstrap, topic, dlq)
        with running(acker):
            # The other batches complete while the producer still holds the first one.
            wait_for(
                lambda: all(batch_state(pg_dsn, schema, b.id)[0] == "complete" for b, _ in batches[1:]),
                timeout=60,
                what="the unlocked batches to complete",
            )
            wait_for(lambda: acker.stats["deferred"] > 0, what="a deferral")
            assert batch_state(pg_dsn, schema, held_batch.id) == ("open", 9000)
            assert (
                REGISTRY.get_sample_value("reaper_acker_deferred_total", {"schema": schema}) or 0.0
            ) > deferred_before
            # offsets are not committed past the deferred acks
            assert committed(kafka_bootstrap, acker.group, topic, 2) != end_offsets(kafka_bootstrap, topic, 2)
            producer.commit()  # the producer lets go: the deferred acks are applied
            wait_for(lambda: batch_state(pg_dsn, schema, held_batch.id) == ("open", 1), what="the deferred acks")
            wait_for(
                lambda: committed(kafka_bootstrap, acker.group, topic, 2) == end_offsets(kafka_bootstrap, topic, 2),
                what="offsets committed to the end",
            )
        assert acker.stats["acked"] == 9000 + 300 + 50
    with psycopg.connect(pg_dsn) as c:
        tracker.ack(c, extra.item_ids, schema=schema)
        assert tracker.close_batch(c, held_batch, schema=schema) is True
        c.commit()
        keys = sorted(k for k, _ in completion_events(c, schema))
        assert keys == sorted(str(b.id).encode() for b, _ in batches)
        assert invariant_violations(c, schema) == []
