"""The message-id namespace of an outbox table that does not exist: an outbox of the application's
own (an entry of harvester.outboxes, `reaper run`'s units ask for it before each mark) is not
blamed on a missing migration, which never makes it; NamespaceUnavailable says how to make it, as
the commands and the start-up check do (tracker.schema.missing_table)."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from support.harness import wait_until
from support.reaper import ReaperProcess

from tracker import message_ids
from tracker.message_ids import NamespaceUnavailable


@pytest.mark.parametrize("table", ["orders_outbox", "Orders"])
def test_a_missing_outbox_table_of_the_application_says_how_to_make_it(conn, schema, table) -> None:
    conn.execute("SELECT 1")  # the caller's transaction, left as it was
    with pytest.raises(NamespaceUnavailable) as err:
        message_ids.namespace(conn, schema, table)
    text = str(err.value)
    assert "run `reaper migrate`" not in text, text
    written = table if table == table.lower() else f'"{table}"'
    assert f"CREATE TABLE {schema}.{written} (LIKE {schema}.outbox INCLUDING ALL)" in text, text
    assert not err.value.missing_table  # the namespace table is there: nothing for the harvester to make
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert conn.execute("SELECT 2").fetchone() == (2,)


def test_a_missing_outbox_table_reaper_migrate_makes_still_asks_for_it(conn, schema) -> None:
    conn.execute("DROP TABLE outbox CASCADE")
    with pytest.raises(NamespaceUnavailable, match=r"does not exist: run `reaper migrate`"):
        message_ids.namespace(conn, schema, "outbox")


def test_reaper_run_says_how_to_make_a_missing_entry_table(pg_dsn, kafka_bootstrap, schema, tmp_path) -> None:
    env = {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__LEADER_TOPIC": f"leader-{uuid.uuid4().hex[:10]}",
        "REAPER_HARVESTER__LEADER_GROUP": f"g-{uuid.uuid4().hex[:8]}",
        "REAPER_HARVESTER__OUTBOXES": json.dumps([{"name": "main"}, {"name": "orders", "table": "orders_outbox"}]),
    }
    proc = ReaperProcess(env, tmp_path / "reaper.log")
    try:
        failed: list[dict] = []

        def failures() -> list[dict]:
            failed[:] = [e for e in proc.events() if e.get("unit") == "orders" and "error" in e]
            return failed

        wait_until(lambda: bool(failures()) or proc.proc.poll() is not None, 60, step=0.5)
        assert failed, proc.log_path.read_text()[-3000:]
        error = failed[0]["error"]
        assert "run `reaper migrate`" not in error and "CREATE TABLE" in error, error
    finally:
        proc.terminate()
        proc.kill()
