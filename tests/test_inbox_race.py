"""Exactly-once effects under races and crashes, on the real Postgres: consumers receive the same
messages (each several times) in random order, and some deliveries crash between the effect and
the commit (a rollback, or the server killing the connection); a crashed delivery comes again
later, as Kafka would redeliver it. Every effect is a row written in the consumer's transaction:
each (consumer, message) must end with exactly one effect row and one inbox id."""

from __future__ import annotations

import random
import threading
import uuid
from collections import deque

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from tracker.inbox import Inbox

EFFECTS = "CREATE TABLE effects (consumer text NOT NULL, message_id text NOT NULL, worker int NOT NULL)"


def _setup(dsn: str, schema: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        c.execute("DROP TABLE IF EXISTS effects")
        c.execute(EFFECTS)
        c.execute("TRUNCATE inbox")


def _outcome(dsn: str, schema: str) -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]]]:
    with psycopg.connect(dsn) as c:
        c.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        effects = c.execute("SELECT consumer, message_id, count(*) FROM effects GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
        ids = c.execute("SELECT consumer, message_id, count(*) FROM inbox GROUP BY 1, 2 ORDER BY 1, 2").fetchall()
    return effects, ids


class Worker(threading.Thread):
    """One consumer instance: its deliveries in order; a crashed one goes to the back of its queue."""

    def __init__(self, n: int, dsn: str, schema: str, consumer: str, deliveries: list[str], rng: random.Random):
        super().__init__(name=f"inbox-worker-{n}", daemon=True)
        self.n, self.dsn, self.schema, self.rng = n, dsn, schema, rng
        self.box = Inbox(consumer, schema=schema, registry=None)
        self.queue = deque(deliveries)
        self.crashes = self.duplicates = self.firsts = 0
        self.error: BaseException | None = None

    def _effect(self, message_id: str):
        def run(conn: psycopg.Connection) -> None:
            conn.execute(
                sql.SQL("INSERT INTO {} VALUES (%s, %s, %s)").format(sql.Identifier(self.schema, "effects")),
                [self.box.consumer, message_id, self.n],
            )

        return run

    def run(self) -> None:
        try:
            conn = psycopg.connect(self.dsn)
            while self.queue:
                mid = self.queue.popleft()
                crash = self.rng.random()
                try:
                    done = self.box.run_once(conn, mid, self._effect(mid))
                    if crash < 0.15:
                        conn.rollback()  # crashed before the commit
                        raise ConnectionAbortedError
                    if crash < 0.25:
                        with psycopg.connect(self.dsn, autocommit=True) as admin:  # the server kills it
                            admin.execute("SELECT pg_terminate_backend(%s)", [conn.info.backend_pid])
                        conn.commit()  # fails: the connection is gone, nothing committed
                        raise AssertionError("a commit on a killed connection succeeded")
                    conn.commit()
                    self.firsts += done.first_time
                    self.duplicates += not done.first_time
                except (ConnectionAbortedError, psycopg.OperationalError):
                    self.crashes += 1
                    self.queue.append(mid)  # redelivered later
                    if conn.closed or conn.broken:
                        conn = psycopg.connect(self.dsn)
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _round(
    dsn: str, schema: str, seed: int, workers: int, messages: int, consumers: int, exercised: bool = False
) -> None:
    _setup(dsn, schema)
    rng = random.Random(seed)
    ids = [f"msg-{seed}-{i}-{uuid.uuid4().hex[:6]}" for i in range(messages)]
    threads = []
    for n in range(workers):
        deliveries = ids * 2  # each worker sees every message twice (a duplicate delivery)
        rng.shuffle(deliveries)
        consumer = f"group-{n % consumers}"
        threads.append(Worker(n, dsn, schema, consumer, deliveries, random.Random(rng.random())))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a worker hung"
        assert t.error is None, t.error
    effects, inbox_ids = _outcome(dsn, schema)
    expected = sorted((f"group-{c}", m, 1) for c in range(consumers) for m in ids)
    assert effects == expected, "an effect ran twice or never"
    assert inbox_ids == expected
    if exercised:  # the round crashed and deduplicated some deliveries (small random ones may not)
        assert sum(t.crashes for t in threads) > 0 and sum(t.duplicates for t in threads) > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_concurrent_consumers_with_crashes_run_each_effect_once(pg_dsn, schema, seed):
    # 4 instances in 2 consumer groups: each group processes each message once.
    _round(pg_dsn, schema, seed, workers=4, messages=40, consumers=2, exercised=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(2, 5),
    messages=st.integers(1, 25),
    consumers=st.integers(1, 2),
)
def test_any_mix_of_consumers_and_deliveries(pg_dsn, schema, seed, workers, messages, consumers):
    """Hypothesis picks the number of instances, messages and groups, and the order and crashes
    (from the seed)."""
    _round(pg_dsn, schema, seed, workers=workers, messages=messages, consumers=min(consumers, workers))
