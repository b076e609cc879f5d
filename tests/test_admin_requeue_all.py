"""`reaper dead requeue --all` / `--reason` move every row dead when they started, even a row another
transaction held for a moment without moving it (a failed `--id`, a `SELECT ... FOR UPDATE` by
hand): they wait for it rather than report success with it still dead. A dry run locks nothing.
They report every row they moved in `moved` but name only the first ID_SAMPLE, so their memory does
not grow with the dead table."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.harness import make_config, wait_until
from test_admin import add_dead, as_json, reaper

from harvester.admin import dead as dead_mod


def _dead_left(pg_dsn: str, schema: str) -> list[int]:
    with psycopg.connect(pg_dsn) as c:
        return [r[0] for r in c.execute(f'SELECT id FROM "{schema}".outbox_dead ORDER BY id')]


def _waits_for_a_lock(pg_dsn: str, app: str) -> bool:
    with psycopg.connect(pg_dsn) as c:
        row = c.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'", [app]
        ).fetchone()
    return row is not None and row[0] > 0


@pytest.mark.parametrize("chunk, reason", [(1000, None), (2, None), (2, "held")])
def test_requeue_all_moves_a_row_another_transaction_holds_then_lets_go(pg_dsn, schema, chunk, reason):
    ids = add_dead(pg_dsn, schema, "t-dead", 6, "held for a moment")
    app = f"requeue-{uuid.uuid4().hex[:8]}"
    done: list[dead_mod.Requeued] = []
    errors: list[BaseException] = []

    def requeue() -> None:
        try:
            with psycopg.connect(pg_dsn, application_name=app) as conn:
                done.append(dead_mod.requeue_matching(conn, schema, "outbox", reason=reason, chunk=chunk))
        except BaseException as exc:
            errors.append(exc)

    # A transaction that locks two rows in the middle and then rolls back, moving nothing: what
    # `dead requeue --id` does when one of its ids is missing.
    holder = psycopg.connect(pg_dsn)
    try:
        holder.execute(dead_mod._statements(schema, "outbox")["lock_ids"], {"ids": ids[2:4]}).fetchall()
        worker = threading.Thread(target=requeue)
        worker.start()
        assert wait_until(lambda: not worker.is_alive() or _waits_for_a_lock(pg_dsn, app), 60)
    finally:
        holder.rollback()
        holder.close()
    worker.join(60)
    assert not worker.is_alive() and not errors, errors
    assert _dead_left(pg_dsn, schema) == [], f"reported {done[0].moved} moved, left dead"
    assert done[0].moved == 6 and sorted(done[0].dead_ids) == ids and done[0].ids_complete
    with psycopg.connect(pg_dsn) as c:
        logged = c.execute(f"SELECT sum(rows) FROM \"{schema}\".admin_log WHERE action = 'dead-requeue'").fetchone()
        assert logged is not None and logged[0] == 6


def test_a_dry_run_by_id_locks_no_row(pg_dsn, schema):
    ids = add_dead(pg_dsn, schema, "t-dead", 3, "x")
    holder = psycopg.connect(pg_dsn)
    try:
        holder.execute(f'SELECT id FROM "{schema}".outbox_dead WHERE id = %s FOR UPDATE', [ids[0]]).fetchall()
        # A dry run that waited for the lock would fail here (lock_timeout) instead of answering.
        with psycopg.connect(pg_dsn, options="-c lock_timeout=2000") as conn:
            dry = dead_mod.requeue_ids(conn, schema, "outbox", ids, dry_run=True)
    finally:
        holder.rollback()
        holder.close()
    assert (dry.moved, dry.dry_run, dry.dead_ids) == (3, True, ids)
    assert _dead_left(pg_dsn, schema) == ids


@given(st.lists(st.integers(0, 700), max_size=8))
def test_a_requeue_counts_every_row_and_names_the_first_id_sample(chunks):
    r, moved = dead_mod.Requeued(), []
    for n in chunks:
        ids = list(range(len(moved) + 1, len(moved) + n + 1))
        moved += ids
        r.add(ids, [i + 10**6 for i in ids])
    assert r.moved == len(moved)
    assert r.dead_ids == moved[: dead_mod.ID_SAMPLE] and r.new_ids == [i + 10**6 for i in r.dead_ids]
    assert r.ids_complete == (len(moved) <= dead_mod.ID_SAMPLE)


def test_requeue_all_json_names_the_first_ids_and_says_they_are_not_all(pg_dsn, kafka_bootstrap, schema, topics):
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"))
    n = dead_mod.ID_SAMPLE + 500
    ids = add_dead(pg_dsn, schema, "t-dead", n, "many")
    doc = as_json(reaper(cfg, "dead", "requeue", "--all", "--chunk", "300", "--json"))
    assert doc["moved"] == n and doc["ids_complete"] is False
    assert doc["dead_ids"] == ids[: dead_mod.ID_SAMPLE] and len(doc["new_ids"]) == dead_mod.ID_SAMPLE
    assert _dead_left(pg_dsn, schema) == []
    few = add_dead(pg_dsn, schema, "t-dead", 3, "few")
    doc = as_json(reaper(cfg, "dead", "requeue", "--reason", "few", "--json"))
    assert (doc["moved"], doc["dead_ids"], doc["ids_complete"]) == (3, few, True) and len(doc["new_ids"]) == 3
    text = reaper(cfg, "dead", "requeue", "--all")
    assert text.returncode == 0 and "requeued 0 rows" in text.stdout
