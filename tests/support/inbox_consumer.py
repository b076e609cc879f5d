"""A consumer process for the inbox's Kafka tests: consumes a topic with tracker.inbox.consumer,
writing one effect row per record (slowly, so a test can kill it midway), until the topic has been
idle for `idle` seconds.

    python -m support.inbox_consumer BOOTSTRAP TOPIC GROUP DSN SCHEMA IDLE
"""

from __future__ import annotations

import sys
import time

import psycopg
from psycopg import sql

from tracker.inbox import Inbox
from tracker.inbox.consumer import InboxConsumer, message_id_of


def main(bootstrap: str, topic: str, group: str, dsn: str, schema: str, idle: float) -> None:
    insert = sql.SQL("INSERT INTO {} (message_id, consumer_pid) VALUES (%s, %s)").format(
        sql.Identifier(schema, "effects")
    )

    def effect(conn: psycopg.Connection, record) -> None:
        conn.execute(insert, [message_id_of(record), __import__("os").getpid()])
        time.sleep(0.002)

    # A short session: the group hands a killed consumer's partitions on within seconds.
    config = {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": 6000,
    }
    with psycopg.connect(dsn) as conn:
        c = InboxConsumer(config, [topic], conn, Inbox("e2e", schema=schema, registry=None), effect, batch=20)
        last = time.monotonic()
        try:
            while time.monotonic() - last < idle:
                if c.poll_once().records:
                    last = time.monotonic()
                    print("progress", c.totals.processed, flush=True)
        finally:
            c.close()


if __name__ == "__main__":
    main(*sys.argv[1:6], float(sys.argv[6]))
