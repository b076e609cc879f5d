"""How soon publishing resumes after a dependency answers again (tests and bench.harvest share it).

The gap runs from the moment the restarted service answers (the caller's `answered_at`, taken when
PrivateServices.up() returns: Postgres accepts connections, Kafka answers a metadata request) to the
first purge of the lowest row waiting then (or, if none was, of the first row written afterwards:
an upper bound then, as it includes the writer's own reconnect). A purge happens only after Kafka acknowledged
the record and the database accepted the delete, so it proves the whole path works again.
"""

from __future__ import annotations

import time

import psycopg
from psycopg import sql


def resume_gap(dsn: str, schema: str, answered_at: float, timeout: float = 60.0, step: float = 0.01) -> float:
    """Seconds from `answered_at` (time.monotonic()) to the purge of the lowest row waiting then.

    Raises TimeoutError when nothing is purged within `timeout`.
    """
    table = sql.Identifier(schema, "outbox")
    deadline = answered_at + timeout
    conn = None
    while conn is None:  # the database may itself be the service just restarted
        try:
            conn = psycopg.connect(dsn, autocommit=True, connect_timeout=2)
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise TimeoutError("the database did not accept connections") from None
            time.sleep(step)
    with conn:
        first = sql.SQL("SELECT min(id) FROM {}").format(table)
        still = sql.SQL("SELECT 1 FROM {} WHERE id = %s").format(table)
        watched = None  # the lowest row waiting (after a database restart: the first one written again)
        while time.monotonic() < deadline:
            now = time.monotonic()
            if watched is None:
                watched = conn.execute(first).fetchone()[0]
            elif conn.execute(still, [watched]).fetchone() is None:
                return now - answered_at
            time.sleep(step)
    raise TimeoutError(f"no row purged within {timeout} s of the service answering again")
