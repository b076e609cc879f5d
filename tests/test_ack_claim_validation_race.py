"""Acks of ids whose batch or group is being created right now get a typed error or an ack, never
anything else.

ack_claim_items (sql/R__ack_claims.sql) decides validity and reports what it saw in one statement: the review
of 2026-11-23 found that with two statements, one could see a batch missing and the next see it
committed, and the caller then got an AssertionError instead of UnknownBatch/UnknownGroup.
"""

from __future__ import annotations

import threading
import time

import psycopg

import tracker
from tracker.errors import UnknownBatch, UnknownGroup


def test_acks_of_batches_being_created_get_typed_errors_or_acks(pg_dsn, schema):
    stop = threading.Event()
    newest = [0]
    errors: list[BaseException] = []

    def create() -> None:
        try:
            with psycopg.connect(pg_dsn) as c:
                while not stop.is_set():
                    batch = tracker.open_batch(c, schema=schema)
                    tracker.add_items(c, batch, 3, schema=schema)
                    c.commit()
                    newest[0] = batch.id
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    creator = threading.Thread(target=create, daemon=True)
    creator.start()
    outcomes = {"acked": 0, "unknown batch": 0, "unknown group": 0}
    try:
        with psycopg.connect(pg_dsn) as c:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline:
                # the next batches' first group: usually not committed yet, sometimes just committing
                for ahead in (1, 2):
                    try:
                        tracker.ack(c, [f"{newest[0] + ahead}:0:0"], schema=schema)
                        outcomes["acked"] += 1
                    except UnknownBatch:
                        outcomes["unknown batch"] += 1
                    except UnknownGroup:
                        outcomes["unknown group"] += 1
                    c.commit()
    finally:
        stop.set()
        creator.join(30)
    assert not errors, errors
    assert outcomes["unknown batch"] > 0, outcomes
