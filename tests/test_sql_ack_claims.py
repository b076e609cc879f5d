"""The SQL function ack() claims up to 1,000 items, as tracker.ack does: it holds no batch row for
the rest of the caller's transaction, so consumers of one batch ack (and run their effects) in
parallel, and the batch completes exactly once when the last ack commits (or, when another
transaction held its row at that moment, at the reaper settler's next pass). A larger ack takes
the masked path and reports what it finished. Real Postgres; a consumer role calls it too."""

from __future__ import annotations

import random
import threading

import psycopg
import pytest
from psycopg import sql

import tracker


def _closed_batch(dsn: str, schema: str, n: int) -> tuple[int, int]:
    with psycopg.connect(dsn) as c:
        b = tracker.open_batch(c, schema=schema)
        (g,) = tracker.add_items(c, b, n, schema=schema)
        tracker.close_batch(c, b, schema=schema)
        c.commit()
    return b.id, g.group_id


def _ack(schema: str) -> sql.Composed:
    return sql.SQL("SELECT * FROM {}.ack(%s)").format(sql.Identifier(schema))


def _events(conn: psycopg.Connection, schema: str, batch_id: int) -> int:
    q = sql.SQL("SELECT count(*) FROM {} WHERE header_keys = ARRAY['batch-id'] AND key = convert_to(%s::text, 'UTF8')")
    (n,) = conn.execute(q.format(sql.Identifier(schema, "outbox")), [batch_id]).fetchone()
    return n


def test_consumers_of_one_batch_ack_in_parallel_without_waiting_for_each_other(pg_dsn, schema):
    b, g = _closed_batch(pg_dsn, schema, 4)
    consumers = [psycopg.connect(pg_dsn) for _ in range(4)]
    try:
        for n, c in enumerate(consumers):  # each acks its item and keeps its transaction open
            c.execute("SET lock_timeout = '2s'")
            assert c.execute(_ack(schema), [[f"{b}:{g}:{n}"]]).fetchone() == (1, 0, [])
        for c in consumers:
            c.commit()
    finally:
        for c in consumers:
            c.close()
    with psycopg.connect(pg_dsn) as c:
        tracker.settle(c, schema=schema, registry=None)  # the reaper's settler, for a commit that met a held row
        c.commit()
        assert tracker.status(c, tracker.Batch(b), schema=schema).state == "complete"
        assert _events(c, schema, b) == 1


def test_an_ack_of_more_than_1000_items_is_the_masked_path_and_reports_its_completion(pg_dsn, schema):
    b, g = _closed_batch(pg_dsn, schema, 1500)
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(_ack(schema), [[f"{b}:{g}:0-1499"]]).fetchone() == (1500, 0, [b])
        c.commit()
        assert _events(c, schema, b) == 1


@pytest.mark.parametrize("rounds", [8])
def test_racing_sql_acks_complete_each_batch_exactly_once(pg_dsn, schema, rounds):
    """Many consumers ack overlapping runs of one batch at once, some roll back; once every item
    is acked by a commit and the settler has passed, the batch is complete with one event."""
    rng = random.Random(52)
    for _ in range(rounds):
        size = rng.randint(5, 60)
        b, g = _closed_batch(pg_dsn, schema, size)
        barrier = threading.Barrier(6)
        errors: list[BaseException] = []

        def consume(seed: int) -> None:
            r = random.Random(seed)
            try:
                with psycopg.connect(pg_dsn) as c:
                    barrier.wait(30)
                    for _ in range(r.randint(1, 4)):
                        lo = r.randrange(size)
                        hi = min(size - 1, lo + r.randint(0, 10))
                        c.execute(_ack(schema), [[f"{b}:{g}:{lo}-{hi}"]])
                        (c.rollback if r.random() < 0.3 else c.commit)()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=consume, args=(rng.random(),)) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        with psycopg.connect(pg_dsn) as c:
            c.execute(_ack(schema), [[f"{b}:{g}:0-{size - 1}"]])  # whatever the race left
            c.commit()
            tracker.settle(c, schema=schema, registry=None)
            c.commit()
            s = tracker.status(c, tracker.Batch(b), schema=schema)
            assert (s.state, s.pending, s.succeeded) == ("complete", 0, size)
            assert _events(c, schema, b) == 1


def test_an_ack_naming_more_than_1000_items_with_repeats_takes_the_masked_path(pg_dsn, schema):
    """The claim path expands the items as named: it is taken only for up to 1,000 of them, repeats
    counted, so no call can make it expand more (20,000 copies of one run of 1,000 made 20 million
    rows to sort); past that, the masked path folds the call into one mask per group."""
    b, g = _closed_batch(pg_dsn, schema, 1000)
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(_ack(schema), [[f"{b}:{g}:0-999"] * 2]).fetchone() == (1000, 1000, [b])
        c.commit()
        assert _events(c, schema, b) == 1
