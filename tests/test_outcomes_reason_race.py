"""Retention deleting a failure reason races a fail() storing items under the same reason.

Each round: a finished batch whose only failed item has reason R (so retention may delete R), and
an open batch; one connection sweeps (deletes the finished batch and, with it, R once unused),
another fails an item of the open batch with R, in randomized order and timing, each holding its
transaction open a random while. Neither may fail (no foreign-key violation, no serialization
error at READ COMMITTED), the failed item must read back with R, and no reason may be left that no
item failed under."""

from __future__ import annotations

import random
import threading
import time

import psycopg

import tracker
from tracker.expiry import sweep

ROUNDS = 120


def test_fail_with_a_reason_retention_is_deleting_never_errs_nor_loses_it(pg_dsn, schema):
    rng = random.Random(7)
    with psycopg.connect(pg_dsn) as setup, psycopg.connect(pg_dsn) as a, psycopg.connect(pg_dsn) as b:
        for c in (setup, a, b):
            c.execute(f'SET search_path TO "{schema}"')
            c.commit()
        for round_no in range(ROUNDS):
            reason = f"upstream refused, round {round_no % 5}"  # reused across rounds, as real ones are
            old = tracker.open_batch(setup, schema=schema)
            tracker.add_items(setup, old, 1, schema=schema)
            tracker.fail(setup, [f"{old.id}:0:0"], reason, schema=schema)
            tracker.close_batch(setup, old, schema=schema)
            live = tracker.open_batch(setup, schema=schema)
            tracker.add_items(setup, live, 1, schema=schema)
            setup.commit()
            errors: list[BaseException] = []
            delays = [rng.random() * 0.004 for _ in range(4)]

            def sweeper() -> None:
                try:
                    time.sleep(delays[0])
                    a.execute("SELECT 1")  # a transaction open: sweep runs in it, commits nothing
                    got = sweep(a, schema=schema, idle_expiry=3600, retention=0, registry=None)
                    time.sleep(delays[1])
                    a.commit()
                    assert got.deleted >= 1
                except BaseException as exc:  # noqa: BLE001 - reported below
                    a.rollback()
                    errors.append(exc)

            def failer() -> None:
                try:
                    time.sleep(delays[2])
                    r = tracker.fail(b, [f"{live.id}:0:0"], reason, schema=schema)
                    time.sleep(delays[3])
                    b.commit()
                    assert r.failed == 1
                except BaseException as exc:  # noqa: BLE001 - reported below
                    b.rollback()
                    errors.append(exc)

            threads = [threading.Thread(target=sweeper), threading.Thread(target=failer)]
            rng.shuffle(threads)
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert errors == [], f"round {round_no}: {errors!r}"
            page = tracker.failures(setup, live, schema=schema)
            assert page.items == [(f"{live.id}:0:0", reason)], f"round {round_no}"
            orphans = setup.execute(
                "SELECT r.text FROM failure_reason r WHERE NOT EXISTS "
                "(SELECT FROM group_failure f WHERE f.reason_id = r.id)"
            ).fetchall()
            assert orphans == [], f"round {round_no}"
            # The live batch finishes and ages out in a later round, its reason with it (or kept,
            # while another round's item still has it).
            tracker.close_batch(setup, live, schema=schema)
            setup.commit()
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'SET search_path TO "{schema}"')
        sweep(c, schema=schema, idle_expiry=3600, retention=0, registry=None)
        c.commit()
        assert c.execute("SELECT count(*) FROM failure_reason").fetchone() == (0,)
        assert c.execute("SELECT count(*) FROM batch").fetchone() == (0,)
