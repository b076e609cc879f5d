"""A unit whose database is down at start, or accepts connections and never answers (a hung host),
holds up no other unit of the same reaper, and a SIGTERM still ends the process at once (exit 0):
`reaper run` as a subprocess, with two outboxes, one of them on such a database."""

from __future__ import annotations

import json
import signal
import time
import uuid

import psycopg
import pytest
from support.harness import Receiver, insert_rows
from support.ports import free_port
from support.reaper import ReaperProcess

pytestmark = pytest.mark.slow


@pytest.fixture
def refused_server() -> str:
    """host:port where nothing listens: a database that is down."""
    return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("down", ["silent_server", "refused_server"])
def test_a_unit_whose_database_is_down_at_start_holds_up_no_other_nor_a_sigterm(
    pg_dsn, kafka_bootstrap, schema, topics, tmp_path, down, request
):
    where = request.getfixturevalue(down)
    topic = topics("data")
    env = {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__LEADER_TOPIC": f"leader-{uuid.uuid4().hex[:10]}",
        "REAPER_HARVESTER__LEADER_GROUP": f"g-{uuid.uuid4().hex[:8]}",
        "REAPER_HARVESTER__DRAIN_TIMEOUT": "5",
        # no connect_timeout in the DSN: libpq alone would wait for ever on the hung one
        "REAPER_HARVESTER__OUTBOXES": json.dumps(
            [{"name": "main"}, {"name": "down", "dsn": f"postgresql://app@{where}/outbox"}]
        ),
    }
    proc = ReaperProcess(env, tmp_path / "reaper.log")
    receiver = Receiver(kafka_bootstrap, topic, 1)
    try:
        rows = [(b"k", b"v%d" % i) for i in range(20)]
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, topic, rows)
        published = receiver.wait_for(set(rows), 60)
        failed = [e for e in proc.events() if e.get("event") in ("component failed", "cannot start")]
        assert published and proc.proc.poll() is None, (published, proc.proc.poll(), failed)
        sent = time.monotonic()
        proc.signal(signal.SIGTERM)
        code = proc.wait(120)
        took = time.monotonic() - sent
        errors = [e for e in proc.events() if e.get("level") == "error"]
        # drain_timeout (5 s) bounds the drain; the down unit adds at most a connection wait (a lease)
        assert code == 0 and took < 20, (took, code, errors)
    finally:
        receiver.close()
        proc.kill()
