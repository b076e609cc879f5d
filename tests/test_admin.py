"""The admin commands against real Postgres and Kafka: `reaper outbox status`, `reaper dead list`,
`reaper dead requeue` (including racing a running harvester and another requeue), `reaper batch
show` and `reaper batch expire`; bad arguments fail with clear errors and change nothing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.harness import Generator, Receiver, env_for, make_config, running, wait_until
from support.reaper import run_cli

import tracker
from harvester.admin import batch as batch_mod
from harvester.admin import dead as dead_mod
from harvester.exit_codes import ExitCode
from harvester.units import Harvester
from tracker import outbox
from tracker.ids import parse_item_id

REPO = Path(__file__).resolve().parents[1]


def reaper(cfg, *args: str, timeout: float = 120, extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(env_for(cfg))
    env.update(extra or {})
    return run_cli(list(args), env, timeout)


def as_json(r: subprocess.CompletedProcess) -> dict:
    assert r.stdout.strip(), r.stderr
    return json.loads(r.stdout)


def counts(pg_dsn: str, schema: str) -> dict[str, object]:
    """Everything an admin command could change."""
    with psycopg.connect(pg_dsn) as c:
        out = {
            t: c.execute(f'SELECT count(*), coalesce(max(id), 0) FROM "{schema}".{t}').fetchone()
            for t in ("outbox", "outbox_dead", "admin_log", "batch")
        }
        out["states"] = c.execute(f'SELECT id, state FROM "{schema}".batch ORDER BY id').fetchall()
    return out


def add_dead(pg_dsn: str, schema: str, topic: str, n: int, reason: str, prefix: str = "dead") -> list[int]:
    """Rows as the leader quarantines them: an outbox id (from its sequence), the row, a reason."""
    with psycopg.connect(pg_dsn) as c:
        ids = [
            r[0]
            for r in c.execute(
                f'INSERT INTO "{schema}".outbox_dead (id, created_at, topic, key, value, header_keys, header_values, '
                "leader_id, reason) SELECT nextval(pg_get_serial_sequence(%s, 'id')), now(), %s, "
                "convert_to('k' || mod(g, 7), 'UTF8'), convert_to(%s || g, 'UTF8'), ARRAY['h'], ARRAY['\\x00ff'::bytea], "
                "gen_random_uuid(), %s FROM generate_series(1, %s) g RETURNING id",
                [f'"{schema}".outbox', topic, f"{prefix}-", reason, n],
            ).fetchall()
        ]
    return ids


@pytest.fixture
def cfg(pg_dsn, kafka_bootstrap, schema, topics):
    return make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"))


# ------------------------------------------------------------------ outbox status


def test_outbox_status_shows_backlog_dead_rows_batches_and_the_leader(cfg, pg_dsn, schema, topics, kafka_bootstrap):
    topic = topics("data")
    with psycopg.connect(pg_dsn) as c:
        c.execute(
            f"INSERT INTO \"{schema}\".outbox (topic, value) SELECT %s, convert_to(g::text, 'UTF8') "
            "FROM generate_series(1, 25) g",
            [topic],
        )
        b = tracker.open_batch(c, user_key="s", schema=schema)
        tracker.add_items(c, b, 9, schema=schema)
    add_dead(pg_dsn, schema, topic, 3, "_UNKNOWN_PARTITION: test")
    r = reaper(cfg, "outbox", "status", "--json")
    assert r.returncode == 0, r.stderr
    s = as_json(r)
    [u] = s["units"]
    assert (u["unit"], u["backlog_rows"], u["backlog_exact"], u["in_flight_rows"], u["dead_rows"], u["leader"]) == (
        0,
        25,
        True,
        0,
        3,
        None,
    )
    assert u["oldest_age_seconds"] >= 0 and s["batches"]["open"] == 1 and s["items_pending"] == 9
    with psycopg.connect(pg_dsn) as c:
        first = c.execute(f'SELECT min(id) FROM "{schema}".outbox').fetchone()[0]
    # the row a stall is stuck on: which, of what topic, and whether a leader holds it
    assert (u["oldest_id"], u["oldest_topic"], u["oldest_marked_by"]) == (first, topic, None)
    human = reaper(cfg, "outbox", "status")
    assert (
        human.returncode == 0 and "backlog         25 rows" in human.stdout and "leader          none" in human.stdout
    )
    assert f"id {first}, topic {topic!r}, not marked" in human.stdout, human.stdout

    receiver = Receiver(kafka_bootstrap, topic)
    try:
        with running(cfg):
            assert receiver.wait_for({(None, str(i).encode()) for i in range(1, 26)}, 30)
            s = as_json(reaper(cfg, "outbox", "status", "--json"))
            [u] = s["units"]
            assert u["backlog_rows"] == 0 and u["leader"] is not None, s
            assert u["leader"]["member_id"] and u["leader"]["host"], u
            assert s["group_state"] == "stable"
            assert re.search(r"leader          \S+ client", reaper(cfg, "outbox", "status").stdout)
    finally:
        receiver.close()


def test_outbox_status_with_kafka_unreachable_shows_the_database_and_exits_3(cfg, pg_dsn, schema):
    r = reaper(
        cfg, "outbox", "status", "--json", "--timeout", "2", extra={"REAPER_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    )
    assert r.returncode == 3, r.stdout + r.stderr
    s = json.loads(r.stdout)
    assert s["kafka_error"] and s["units"][0]["backlog_rows"] == 0
    for line in r.stderr.splitlines():  # Kafka's own complaints come as structlog JSON lines
        assert json.loads(line)["event"], line


# ------------------------------------------------------------------ dead list / requeue


def test_dead_list_pages_filters_and_prints_json(cfg, pg_dsn, schema):
    size = add_dead(pg_dsn, schema, "t", 5, "MSG_SIZE_TOO_LARGE: Broker: Message size too large")
    part = add_dead(pg_dsn, schema, "t", 4, "_UNKNOWN_PARTITION: Local: Unknown partition")
    first = as_json(reaper(cfg, "dead", "list", "--json", "--limit", "3"))
    assert [r["id"] for r in first["rows"]] == size[:3] and first["matching"] == 9 and first["next_after"] == size[2]
    rest = as_json(reaper(cfg, "dead", "list", "--json", "--limit", "100", "--after", str(first["next_after"])))
    assert [r["id"] for r in rest["rows"]] == size[3:] + part and rest["next_after"] is None
    row = rest["rows"][0]
    assert row["key"] == {"text": "k4"} and row["headers"] == ["h"] and row["value_bytes"] == len("dead-4")
    only = as_json(reaper(cfg, "dead", "list", "--json", "--reason", "Unknown partition"))
    assert [r["id"] for r in only["rows"]] == part and only["matching"] == 4
    text = reaper(cfg, "dead", "list", "--limit", "2")
    assert (
        text.returncode == 0
        and f"next page: --after {size[1]}" in text.stdout
        and "Message size too large" in text.stdout
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["dead", "list", "--limit", "0"], "--limit must be a whole number from 1 to 10000"),
        (["dead", "list", "--limit", "99999999999999999999999"], "--limit must be a whole number"),
        (["dead", "requeue"], "one of the arguments --id --all --reason is required"),
        (["dead", "requeue", "--id", "1", "--all"], "not allowed with argument"),
        (["dead", "requeue", "--id", "7,x"], "a dead row id must be a whole number"),
        (["dead", "requeue", "--reason", ""], "--reason must be 1-1000 characters"),
        (["batch", "show", "-3"], "batch id must be a whole number"),
        (["batch", "show", "3", "--after", "3:1"], "malformed item id '3:1'"),
        (["batch", "show", "3", "--after", "4:0:1"], "--after 4:0:1 names batch 4, not 3"),
        (["batch", "expire", "abc"], "batch id must be a whole number"),
        (["outbox", "status", "--timeout", "0"], "timeout must be a number of seconds"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value_and_change_nothing(cfg, pg_dsn, schema, args, message):
    add_dead(pg_dsn, schema, "t", 2, "x")
    before = counts(pg_dsn, schema)
    r = reaper(cfg, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr, r.stderr
    assert counts(pg_dsn, schema) == before


def test_requeue_by_id_moves_all_named_rows_once_or_none(cfg, pg_dsn, schema):
    ids = add_dead(pg_dsn, schema, "t", 4, "_UNKNOWN_PARTITION: x")
    before = counts(pg_dsn, schema)
    # One id is not dead: nothing moves, exit 5, the missing id is named.
    r = reaper(cfg, "dead", "requeue", "--id", f"{ids[0]},{ids[1]}", "--id", "999999999")
    assert r.returncode == 5 and "999999999" in r.stderr and "nothing was requeued" in r.stderr, r.stderr
    r = reaper(cfg, "dead", "requeue", "--id", str(ids[0]), "--dry-run", "--json")
    assert r.returncode == 0 and as_json(r)["dry_run"] and as_json(r)["moved"] == 1
    assert counts(pg_dsn, schema) == before
    r = reaper(cfg, "dead", "requeue", "--id", f"{ids[0]},{ids[2]}", "--json")
    assert r.returncode == 0, r.stderr
    done = as_json(r)
    assert done["moved"] == 2 and done["dead_ids"] == [ids[0], ids[2]] and len(done["new_ids"]) == 2
    with psycopg.connect(pg_dsn) as c:
        back = c.execute(
            f'SELECT id, topic, key, value, header_keys, header_values, leader_id FROM "{schema}".outbox ORDER BY id'
        ).fetchall()
        assert [r[0] for r in back] == done["new_ids"] and min(done["new_ids"]) > max(ids)
        assert [(bytes(r[2]), bytes(r[3]), r[4], [bytes(x) for x in r[5]], r[6]) for r in back] == [
            (b"k1", b"dead-1", ["h"], [b"\x00\xff"], None),
            (b"k3", b"dead-3", ["h"], [b"\x00\xff"], None),
        ]
        assert c.execute(f'SELECT id FROM "{schema}".outbox_dead ORDER BY id').fetchall() == [(ids[1],), (ids[3],)]
        assert c.execute(f'SELECT action, rows FROM "{schema}".admin_log').fetchall() == [("dead-requeue", 2)]
    again = reaper(cfg, "dead", "requeue", "--id", str(ids[0]), "--json")
    assert again.returncode == 5 and as_json(again)["exit_code"] == 5 and str(ids[0]) in as_json(again)["error"]


def test_requeue_racing_a_running_harvester_and_other_requeues_moves_each_row_once(
    cfg, pg_dsn, schema, topics, kafka_bootstrap
):
    topic = topics("data")
    n_dead = 3000
    dead_ids = add_dead(pg_dsn, schema, topic, n_dead, "operator-test: broker was down")
    gen = Generator(pg_dsn, schema, topic, keys=20, per_txn=20)
    receiver = Receiver(kafka_bootstrap, topic)
    bad_values: list[bytes] = []
    stop_bad = threading.Event()

    def refused_rows() -> None:
        # Rows for a partition the topic lacks: the leader quarantines them while the requeues run.
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            i = 0
            while not stop_bad.is_set():
                v = f"bad-{i}".encode()
                c.execute(
                    f'INSERT INTO "{schema}".outbox (topic, value, kafka_partition) VALUES (%s, %s, 7)', [topic, v]
                )
                bad_values.append(v)
                i += 1
                time.sleep(0.02)

    moved: list[int] = []
    errors: list[BaseException] = []

    def library_requeue(chunk: int) -> None:
        try:
            with psycopg.connect(pg_dsn) as c:
                moved.append(dead_mod.requeue_matching(c, schema, "outbox", reason="operator-test", chunk=chunk).moved)
        except BaseException as exc:
            errors.append(exc)

    try:
        with running(cfg):
            gen.start(rate_per_s=2000)
            bad = threading.Thread(target=refused_rows)
            bad.start()
            time.sleep(0.5)
            env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")} | env_for(cfg)
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "harvester.cli",
                    "dead",
                    "requeue",
                    "--reason",
                    "operator-test",
                    "--chunk",
                    "5",
                    "--json",
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert wait_until(lambda: _logged(pg_dsn, schema) > 0, 30), "the CLI requeue never started"
            threads = [threading.Thread(target=library_requeue, args=(c,)) for c in (3, 7)]
            for t in threads:
                t.start()
            out, err = proc.communicate(timeout=120)
            cli = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            for t in threads:
                t.join(60)
            time.sleep(0.5)
            stop_bad.set()
            bad.join(10)
            gen.stop()
            assert cli.returncode == 0, cli.stderr
            assert not errors, errors
            total = sum(moved) + as_json(cli)["moved"]
            assert total == n_dead, (moved, as_json(cli)["moved"])
            print("moved by the CLI and the two library requeues:", as_json(cli)["moved"], moved)
            want = {(f"k{i % 7}".encode(), f"dead-{i}".encode()) for i in range(1, n_dead + 1)} | gen.committed
            assert receiver.wait_for(want, 60), len(want - receiver.unique())
            assert wait_until(lambda: _dead_values(pg_dsn, schema) >= set(bad_values), 30)
    finally:
        stop_bad.set()
        receiver.close()
    with psycopg.connect(pg_dsn) as c:
        assert (
            c.execute(f'SELECT count(*) FROM "{schema}".outbox_dead WHERE id = ANY(%s)', [dead_ids]).fetchone()[0] == 0
        )
        assert (
            c.execute(f"SELECT count(*) FROM \"{schema}\".outbox_dead WHERE reason LIKE 'operator-test%%'").fetchone()[
                0
            ]
            == 0
        )
        assert (
            c.execute(f"SELECT sum(rows) FROM \"{schema}\".admin_log WHERE action = 'dead-requeue'").fetchone()[0]
            == n_dead
        )
        # Each requeued row went back to the outbox exactly once (then was published and purged).
        assert c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0] == 0
    published = [v for v in receiver.values() if v.startswith(b"dead-")]
    assert set(published) == {f"dead-{i}".encode() for i in range(1, n_dead + 1)}


def _logged(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT count(*) FROM "{schema}".admin_log').fetchone()[0]


def _dead_values(pg_dsn: str, schema: str) -> set[bytes]:
    with psycopg.connect(pg_dsn) as c:
        return {bytes(v[0]) for v in c.execute(f'SELECT value FROM "{schema}".outbox_dead')}


def test_requeue_all_in_chunks_reports_progress_and_a_dry_run_changes_nothing(pg_dsn, schema):
    add_dead(pg_dsn, schema, "t", 25, "a")
    add_dead(pg_dsn, schema, "t", 5, "b")
    with psycopg.connect(pg_dsn) as c:
        dry = dead_mod.requeue_matching(c, schema, "outbox", dry_run=True)
        assert (dry.moved, dry.dry_run) == (30, True)
        seen: list[tuple[int, int]] = []
        done = dead_mod.requeue_matching(c, schema, "outbox", chunk=4, progress=lambda n, t: seen.append((n, t)))
        assert done.moved == 30 and len(set(done.dead_ids)) == 30
        assert seen[0] == (0, 30) and seen[-1] == (30, 30) and [n for n, _ in seen] == sorted(n for n, _ in seen)
        assert c.execute(f'SELECT count(*) FROM "{schema}".admin_log').fetchone()[0] == 8  # one row per chunk
        assert dead_mod.requeue_matching(c, schema, "outbox").moved == 0


# ------------------------------------------------------------------ batch show / expire

GROUP = 8192


def expected_runs(batch_id: int, pending: bytearray) -> list[str]:
    """Runs of pending items, group by group, from a flat flag per item (item k = group k // 8192)."""
    runs = []
    for m in re.finditer(b"\x01+", bytes(pending)):
        k, last = m.start(), m.end() - 1
        while k <= last:  # split at group boundaries
            g, i = divmod(k, GROUP)
            j = min(last, (g + 1) * GROUP - 1) - g * GROUP
            runs.append(f"{batch_id}:{g}:{i}" if i == j else f"{batch_id}:{g}:{i}-{j}")
            k = g * GROUP + j + 1
    return runs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n=st.integers(1, 2 * GROUP + 300),
    acks=st.lists(st.tuples(st.integers(0, 2 * GROUP + 299), st.integers(1, 9000)), max_size=8),
    limit=st.integers(1, 7),
)
def test_batch_show_pages_through_exactly_the_pending_runs(pg_dsn, schema, n, acks, limit):
    pending = bytearray(b"\x01" * n)
    ids = []
    for start, length in acks:
        end = min(n, start + length) - 1
        k = start
        while k <= end:
            g, i = divmod(k, GROUP)
            j = min(end, (g + 1) * GROUP - 1) - g * GROUP
            ids.append(f"{{b}}:{g}:{i}-{j}")
            k = g * GROUP + j + 1
        pending[start : end + 1] = bytes(max(0, end + 1 - start))
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, schema=schema)
        tracker.add_items(c, b, n, schema=schema)
        if ids:
            tracker.ack(c, [i.format(b=b.id) for i in ids], schema=schema)
        c.commit()
        got, after = [], None
        for _ in range(10_000):
            view = batch_mod.show(c, schema, b.id, after=after, limit=limit)
            assert len(view.pending_runs) <= limit
            got += view.pending_runs
            if view.next_after is None:
                break
            after = parse_item_id(view.next_after)
        assert got == expected_runs(b.id, pending)
        assert view.pending == sum(pending) and view.groups == -(-n // GROUP)


def test_batch_show_cli_human_and_json(cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, user_key="catalog-7", schema=schema)
        outbox.enqueue(c, b, [b"v"] * 9000, topic="w", schema=schema)  # groups of 8192 and 808
        tracker.ack(c, [f"{b.id}:0:0-8190", f"{b.id}:1:1-806"], schema=schema)
        tracker.close_batch(c, b, schema=schema)
    r = reaper(cfg, "batch", "show", str(b.id), "--json", "--limit", "2")
    v = as_json(r)
    assert (v["state"], v["total"], v["pending"], v["acked"], v["groups"], v["groups_pending"], v["user_key"]) == (
        "closed",
        9000,
        3,
        8997,
        2,
        2,
        "catalog-7",
    )
    assert v["pending_runs"] == [f"{b.id}:0:8191", f"{b.id}:1:0"] and v["next_after"] == f"{b.id}:1:0"
    nxt = as_json(reaper(cfg, "batch", "show", str(b.id), "--json", "--after", v["next_after"]))
    assert nxt["pending_runs"] == [f"{b.id}:1:807"] and nxt["next_after"] is None
    text = reaper(cfg, "batch", "show", str(b.id), "--limit", "2").stdout
    assert "state          closed" in text and f"--after {b.id}:1:0" in text and "9000 total, 3 pending" in text
    missing = reaper(cfg, "batch", "show", "987654321")
    assert missing.returncode == 5 and "unknown batch 987654321" in missing.stderr


def test_batch_show_cli_outcome_counts_parent_children_and_failures_paged(cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        p = tracker.open_batch(c, user_key="parent", tolerated_failures=5, schema=schema)
        kids = [tracker.open_batch(c, parent=p, schema=schema) for _ in range(2)]
        tracker.add_items(c, p, 6, schema=schema)
        tracker.add_items(c, kids[0], 1, schema=schema)
        tracker.fail(c, [f"{p.id}:0:0", f"{p.id}:0:2-3"], "timeout: upstream", schema=schema)
        tracker.fail(c, [f"{p.id}:0:5"], "bad row", schema=schema)
        tracker.ack(c, [f"{p.id}:0:1", f"{p.id}:0:4", f"{kids[0].id}:0:0"], schema=schema)
        tracker.close_batch(c, kids[0], schema=schema)
        tracker.close_batch(c, p, schema=schema)
        c.commit()
    v = as_json(reaper(cfg, "batch", "show", str(p.id), "--json", "--failures-limit", "3"))
    assert (v["state"], v["outcome"], v["succeeded"], v["failed"], v["pending"]) == ("closed", None, 2, 4, 0)
    assert (v["children"], v["children_open"], v["child_ids"], v["parent_id"]) == (2, 1, [k.id for k in kids], None)
    assert v["failures"] == [
        {"item_id": f"{p.id}:0:0", "reason": "timeout: upstream"},
        {"item_id": f"{p.id}:0:2", "reason": "timeout: upstream"},
        {"item_id": f"{p.id}:0:3", "reason": "timeout: upstream"},
    ]
    assert v["failures_next"] == f"{p.id}:0:3"
    nxt = as_json(reaper(cfg, "batch", "show", str(p.id), "--json", "--failures-after", v["failures_next"]))
    assert nxt["failures"] == [{"item_id": f"{p.id}:0:5", "reason": "bad row"}] and nxt["failures_next"] is None
    text = reaper(cfg, "batch", "show", str(p.id), "--failures-limit", "3").stdout
    assert "6 total, 0 pending, 2 succeeded, 4 failed" in text and "outcome        -" in text
    assert f"children       2 (1 not finished, 0 failed): {kids[0].id}, {kids[1].id}" in text
    assert f"{p.id}:0:2  'timeout: upstream'" in text and f"--failures-after {p.id}:0:3" in text
    with psycopg.connect(pg_dsn) as c:  # the last child finishes; its parent folds it in at its next close
        tracker.close_batch(c, kids[1], schema=schema)
        c.commit()
        assert tracker.close_batch(c, p, schema=schema) is True
        c.commit()
    text = reaper(cfg, "batch", "show", str(kids[1].id)).stdout
    assert f"parent         {p.id}" in text and "outcome        succeeded" in text
    done = as_json(reaper(cfg, "batch", "show", str(p.id), "--json"))
    assert (done["state"], done["outcome"], done["children_open"]) == ("complete", "failed", 0)  # 4 failed items
    bad = reaper(cfg, "batch", "show", str(p.id), "--failures-after", f"{p.id + 1}:0:0")
    assert bad.returncode != 0 and f"names batch {p.id + 1}, not {p.id}" in bad.stderr
    bad = reaper(cfg, "batch", "show", str(p.id), "--failures-limit", "1001")
    assert bad.returncode != 0 and "--failures-limit" in bad.stderr
    bad = reaper(cfg, "batch", "show", str(p.id), "--failures-after", f"{p.id}:0:8192")
    assert bad.returncode == ExitCode.USAGE and f"{p.id}:0:8192" in bad.stderr


def test_batch_expire_writes_the_expiry_event_which_the_harvester_publishes(
    cfg, pg_dsn, schema, topics, kafka_bootstrap
):
    done_topic = topics("done")
    with psycopg.connect(pg_dsn) as c:
        b = tracker.open_batch(c, user_key="stuck", completion_topic=done_topic, schema=schema)
        tracker.add_items(c, b, 5, schema=schema)
        tracker.ack(c, [f"{b.id}:0:0"], schema=schema)
        complete = tracker.open_batch(c, schema=schema)
        tracker.close_batch(c, complete, schema=schema)
    before = counts(pg_dsn, schema)
    for args, code, message in (
        (["batch", "expire", str(complete.id)], 6, "is complete"),
        (["batch", "expire", "424242"], 5, "unknown batch 424242"),
    ):
        r = reaper(cfg, *args)
        assert r.returncode == code and message in r.stderr, r.stderr
    assert counts(pg_dsn, schema) == before
    r = reaper(cfg, "batch", "expire", str(b.id), "--note", "consumer gone", "--json")
    assert r.returncode == 0, r.stderr
    assert as_json(r)["event"] == {"batch_id": b.id, "user_key": "stuck", "total": 5, "pending": 4, "topic": done_topic}
    again = reaper(cfg, "batch", "expire", str(b.id))
    assert again.returncode == 0 and "already expired" in again.stdout
    receiver = Receiver(kafka_bootstrap, done_topic)
    try:
        with running(cfg):
            assert wait_until(lambda: len(receiver.records) >= 1, 30)
            time.sleep(0.5)
    finally:
        receiver.close()
    [(key, value, headers)] = receiver.records
    event = json.loads(value)
    assert key == str(b.id).encode() and dict(headers)["event"] == b"batch-expired"
    assert (event["event"], event["reason"], event["note"], event["pending"], event["acked"], event["user_key"]) == (
        "expired",
        "operator",
        "consumer gone",
        4,
        1,
        "stuck",
    )
    with psycopg.connect(pg_dsn) as c:
        assert c.execute(f'SELECT action, rows FROM "{schema}".admin_log').fetchall() == [("batch-expire", 1)]


def test_requeue_draws_a_progress_bar_on_a_terminal_and_none_otherwise(cfg, pg_dsn, schema):
    import pty  # a pseudo-terminal as stderr: what an operator's shell gives the command

    add_dead(pg_dsn, schema, "t", 300, "slow broker")
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")} | env_for(cfg) | {"TERM": "xterm"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "dead", "requeue", "--all", "--chunk", "1"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
    )
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        drawn += chunk
    out = proc.communicate(timeout=120)[0]
    os.close(master)
    assert proc.returncode == 0 and "requeued 300 rows" in out
    assert b"requeue" in drawn and b"/300" in drawn, drawn[-500:]
    add_dead(pg_dsn, schema, "t", 3, "slow broker")
    piped = reaper(cfg, "dead", "requeue", "--all")
    assert piped.returncode == 0 and piped.stderr == "" and "requeued 3 rows" in piped.stdout


class _CoordinatorNotReady:
    """An AdminClient whose group coordinator answers NOT_COORDINATOR `failures` times (as a fresh
    cluster's does while __consumer_offsets loads), then describes a group of one member."""

    calls = 0

    def __init__(self, conf: dict, failures: int) -> None:
        self.failures = failures

    def describe_consumer_groups(self, groups: list[str], request_timeout: float) -> dict:
        from concurrent.futures import Future
        from types import SimpleNamespace

        from confluent_kafka import KafkaError, KafkaException, TopicPartition

        type(self).calls += 1
        future: Future = Future()
        if type(self).calls <= self.failures:
            future.set_exception(KafkaException(KafkaError(KafkaError.NOT_COORDINATOR)))
        else:
            member = SimpleNamespace(
                member_id="m-1",
                client_id="rdkafka",
                host="/10.0.0.1",
                assignment=SimpleNamespace(topic_partitions=[TopicPartition("__reaper_leader", 0)]),
            )
            future.set_result(SimpleNamespace(members=[member], state=SimpleNamespace(name="STABLE")))
        return {groups[0]: future}

    def poll(self, timeout: float) -> int:
        return 0


@pytest.mark.parametrize(("failures", "answered"), [(2, True), (1000, False)])
def test_outbox_status_asks_a_coordinator_that_is_not_ready_again(monkeypatch, failures, answered):
    from confluent_kafka import KafkaException

    from harvester.admin import status
    from harvester.config import Config

    _CoordinatorNotReady.calls = 0
    monkeypatch.setattr(status, "AdminClient", lambda conf: _CoordinatorNotReady(conf, failures))
    if answered:
        holders, state = status.leaders(Config(), timeout=5)
        assert holders == {0: {"member_id": "m-1", "client_id": "rdkafka", "host": "/10.0.0.1"}} and state == "stable"
        assert _CoordinatorNotReady.calls == 3
    else:
        started = time.monotonic()
        with pytest.raises(KafkaException):
            status.leaders(Config(), timeout=1)
        assert time.monotonic() - started < 3  # gives up at the timeout
