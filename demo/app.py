"""The example application: one catalog fans out into N item messages, tracked as one batch.

Everything happens in one database transaction: the application's own write (here a row in
`catalog_run`), the batch, N outbox messages with `outbox.enqueue`, and the close. Nothing is
published and nothing is tracked unless it commits.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import psycopg
from psycopg import sql

import tracker
from tracker import outbox


@dataclass
class FanOut:
    batch_id: int
    items: int
    groups: int
    seconds: float  # open + enqueue + close + commit


def process_catalog(
    dsn: str, *, schema: str, catalog: str, items: int, item_topic: str, completion_topic: str
) -> FanOut:
    started = time.monotonic()
    with psycopg.connect(dsn) as conn:
        # The application's own business write, in the same transaction as the fan-out.
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (catalog text PRIMARY KEY, started_at timestamptz)").format(
                sql.Identifier(schema, "catalog_run")
            )
        )
        conn.execute(
            sql.SQL("INSERT INTO {} VALUES (%s, now())").format(sql.Identifier(schema, "catalog_run")), [catalog]
        )
        batch = tracker.open_batch(conn, user_key=catalog, completion_topic=completion_topic, schema=schema)
        messages = (outbox.Message(json.dumps({"catalog": catalog, "sku": n}), key=f"sku-{n}") for n in range(items))
        groups = outbox.enqueue(conn, batch, messages, topic=item_topic, headers={"origin": "demo"}, schema=schema)
        tracker.close_batch(conn, batch, schema=schema)
        conn.commit()
    return FanOut(batch.id, items, len(groups), time.monotonic() - started)
