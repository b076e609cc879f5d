"""The sweeper covers every schema of the configuration's outboxes that has batch tables, each
expiry event going to that schema's outbox; a schema without batch tables is skipped."""

from __future__ import annotations

import threading
import uuid

import psycopg
from support.harness import make_config, wait_until

import tracker
from harvester.db_pool import make_pool
from harvester.services.sweeper import sweep_loop
from harvester.services.targets import batch_targets, with_batch_tables
from tracker import schema as schema_mod


def _state(pg_dsn: str, schema: str, batch_id: int) -> str:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT state FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()[0]


def test_idle_batches_expire_in_every_outbox_schema(pg_dsn, kafka_bootstrap, schema, topics):
    other, plain = f"t_{uuid.uuid4().hex[:12]}", f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, other)
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # an outbox table with no batch tables beside it
        c.execute(f'CREATE SCHEMA "{plain}"')
        c.execute(f'CREATE TABLE "{plain}".outbox (LIKE "{other}".outbox INCLUDING ALL)')
    pool = make_pool(pg_dsn, 1, name="test-sweeper")
    stop = threading.Event()
    sweeper: threading.Thread | None = None
    try:
        cfg = make_config(
            pg_dsn,
            schema,
            kafka_bootstrap,
            leader_topic=topics("leader", partitions=3),
            harvester={
                "outboxes": [
                    {"name": "main", "schema": schema},
                    {"name": "second", "schema": other},
                    {"name": "plain", "schema": plain},
                ]
            },
            sweeper={"interval": 0.2, "idle_expiry": 1.0},
        )
        assert [t.schema for t in batch_targets(cfg)] == [schema, other, plain]
        targets = with_batch_tables(cfg)
        assert [t.schema for t in targets] == [schema, other]
        with psycopg.connect(pg_dsn) as c:
            a = tracker.open_batch(c, user_key="a", schema=schema)
            b = tracker.open_batch(c, user_key="b", schema=other)
            c.commit()
        sweeper = threading.Thread(target=sweep_loop, args=(cfg, pool, stop, targets), daemon=True)
        sweeper.start()
        assert wait_until(lambda: _state(pg_dsn, schema, a.id) == _state(pg_dsn, other, b.id) == "expired", 30)
        with psycopg.connect(pg_dsn) as c:
            for s in (schema, other):  # each expiry event in its own schema's outbox
                assert c.execute(f'SELECT count(*) FROM "{s}".outbox').fetchone()[0] == 1, s
    finally:
        stop.set()
        if sweeper is not None:
            sweeper.join(30)
        pool.close()
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA "{other}" CASCADE')
            c.execute(f'DROP SCHEMA "{plain}" CASCADE')
