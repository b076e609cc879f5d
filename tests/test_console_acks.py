"""Requeueing dead-lettered acks: the acker's dead-letter topic back onto the ack topic, from the
console (operators only, from a confirmation page, with an audit line) and from `reaper acks requeue`
(the same function), each recorded in admin_log."""

from __future__ import annotations

import json

import httpx
import psycopg
import pytest
from structlog.testing import capture_logs
from support.console import confirmation_of, csrf_of, login
from support.console_server import VIEWER
from support.console_server import cfg as cfg  # noqa: F401  (the console's configuration fixture)
from support.harness import read_messages, wait_until
from support.http_server import TOKEN, RunningServer
from test_admin import reaper

import tracker
from harvester.admin import acks as acks_admin
from harvester.exit_codes import ExitCode


@pytest.fixture
def dead_letters(cfg, pg_dsn, schema, kafka_bootstrap):  # noqa: F811
    """Three acks the acker set aside: two past a group's size, one malformed."""
    from support.acking import make_acker, produce_raw
    from support.acking import running as acker_running

    with psycopg.connect(pg_dsn) as conn:
        b, c = tracker.open_batch(conn, schema=schema), tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 2, schema=schema)
        tracker.add_items(conn, c, 2, schema=schema)
    a = cfg.acker
    produce_raw(
        kafka_bootstrap,
        a.topic,
        [
            (b"1", b"not-an-id"),
            (str(b.id).encode(), f"{b.id}:0:9".encode()),
            (str(c.id).encode(), f"{c.id}:0:9".encode()),
        ],
    )
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, a.topic, a.dead_letter_topic)
    with acker_running(acker):
        assert wait_until(lambda: acker.stats["dead_lettered"] == 3, 60), acker.stats
    return b, c


def _client(server, token: str | None = None) -> httpx.Client:
    c = httpx.Client(base_url=server.url, timeout=60)
    if token is not None:
        assert login(c, token).status_code == 303
    return c


def _logged(pg_dsn: str, schema: str) -> list[tuple[int, dict]]:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            f"SELECT rows, detail FROM \"{schema}\".admin_log WHERE action = 'acks-requeue' ORDER BY id"
        ).fetchall()


def test_an_operator_requeues_one_dead_lettered_ack_from_its_confirmation_page(
    cfg,  # noqa: F811
    dead_letters,
    pg_dsn,
    schema,
    kafka_bootstrap,
    monkeypatch,
):
    a = cfg.acker
    with RunningServer(cfg, [TOKEN]) as server:
        viewer = _client(server, VIEWER)
        page = viewer.get("/console/dead-acks")
        assert page.status_code == 200 and "/console/dead-acks/requeue" not in page.text
        with capture_logs() as logs:
            r = viewer.post("/console/dead-acks/requeue", data={"csrf": csrf_of(page), "at": "0:0", "confirm": "x"})
        assert r.status_code == 403 and "may only look" in r.text
        assert not [e for e in logs if e.get("action")], logs
        assert _client(server, cfg.tenant_token).get("/console/dead-acks/requeue?at=0:0").status_code == 403
        scans: list[object] = []
        with monkeypatch.context() as m:  # the server runs in this process: its scans are seen here
            m.setattr(acks_admin, "select", lambda *args, **kw: scans.append(kw) or ([], 0, 0))
            for path in ("/console/dead-acks/requeue?at=0:0", "/console/dead-acks/requeue?all=1"):
                r = viewer.get(path)  # refused before Kafka is read: a viewer cannot make the console scan it
                assert r.status_code == 403 and "may only look" in r.text, path
            assert scans == []
            assert _client(server, TOKEN).get("/console/dead-acks/requeue?all=1").status_code == 200
            assert len(scans) == 1  # an operator's page does scan: the patch is where the page reads

        c = _client(server, TOKEN)
        page = c.get("/console/dead-acks")
        malformed = [m for m in page.text.split("<tr ") if "not-an-id" in m][0]
        at = malformed.split('data-dead-ack="', 1)[1].split('"', 1)[0]
        assert f'href="/console/dead-acks/requeue?at={at}"' in page.text, page.text
        gone = c.get("/console/dead-acks/requeue?at=0:999999")
        assert gone.status_code == 404 and "No such dead letter" in gone.text
        confirm = c.get(f"/console/dead-acks/requeue?at={at}")
        assert confirm.status_code == 200 and "not-an-id" in confirm.text, confirm.text
        data = {"csrf": csrf_of(confirm), "at": at}
        r = c.post("/console/dead-acks/requeue", data=data)  # not from its confirmation page
        assert r.status_code == 403 and "confirmation page" in r.text
        with capture_logs() as logs:
            r = c.post("/console/dead-acks/requeue", data=data | {"confirm": confirmation_of(confirm)})
        assert r.status_code == 200 and "1 dead-lettered ack" in r.text, r.text
    [line] = [e for e in logs if e.get("action") == "acks-requeue"]
    assert line["outcome"] == "done" and line["token"].startswith("tok-") and line["role"] == "operator", line
    got = read_messages(kafka_bootstrap, a.topic, 4, linger=1.0)
    requeued = [m for m in got if dict(m.headers() or []).get("requeued-from")]
    assert [m.value() for m in requeued] == [b"not-an-id"], got
    assert dict(requeued[0].headers())["requeued-from"] == f"{a.dead_letter_topic}:{at.replace(':', '@')}".encode()
    assert [rows for rows, _ in _logged(pg_dsn, schema)] == [1]


def test_reaper_acks_requeue_moves_every_dead_lettered_ack_with_a_reason(
    cfg,  # noqa: F811
    dead_letters,
    pg_dsn,
    schema,
    kafka_bootstrap,
):
    a = cfg.acker
    extra = {"REAPER_ACKER__TOPIC": a.topic, "REAPER_ACKER__DEAD_LETTER_TOPIC": a.dead_letter_topic}
    dry = reaper(cfg, "acks", "requeue", "--reason", "index out of range", "--dry-run", "--json", extra=extra)
    assert dry.returncode == 0, dry.stderr
    out = json.loads(dry.stdout)
    assert (out["requeued"], out["dry_run"], out["scanned"]) == (2, True, 3), out
    assert _logged(pg_dsn, schema) == []
    done = reaper(cfg, "acks", "requeue", "--reason", "index out of range", extra=extra)
    assert done.returncode == 0 and "2 dead-lettered acks" in done.stdout, (done.stdout, done.stderr)
    got = read_messages(kafka_bootstrap, a.topic, 5, linger=1.0)
    requeued = sorted(m.value() for m in got if dict(m.headers() or []).get("requeued-from"))
    assert requeued == sorted(f"{x.id}:0:9".encode() for x in dead_letters), got
    [(rows, detail)] = _logged(pg_dsn, schema)
    assert rows == 2 and detail["filter"] == {"reason": "index out of range"} and len(detail["from"]) == 2
    missing = reaper(cfg, "acks", "requeue", "--at", "0:999999", extra=extra)
    assert missing.returncode == ExitCode.NOT_FOUND, (missing.stdout, missing.stderr)
    bad = reaper(cfg, "acks", "requeue", "--at", "zero", extra=extra)
    assert bad.returncode == ExitCode.USAGE, bad.stderr


def test_a_dead_letter_goes_back_to_the_ack_topic_it_came_from(pg_dsn, schema, kafka_bootstrap, topics):
    """Every schema's acker sets aside on the one dead-letter topic; batch ids are per schema, so a
    dead letter of another schema's ack topic must go back there, never to acker.topic."""
    from confluent_kafka import Producer
    from support.harness import make_config

    main, other, dead = topics("acks"), topics("acks-other"), topics("acks-dead")
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        harvester={"outboxes": [{"name": "main"}, {"name": "b", "schema": f"{schema}_b", "ack_topic": other}]},
        acker={"topic": main, "dead_letter_topic": dead},
        console={"kafka_timeout": 5},
    )
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    p.produce(dead, key=b"7", value=b"7:0:9", headers=[("reason", b"index out of range"), ("source-topic", other)])
    assert p.flush(30) == 0
    with psycopg.connect(pg_dsn) as conn:
        r = acks_admin.requeue(cfg, conn, reason="index out of range")
    assert r.requeued == 1
    assert [m.value() for m in read_messages(kafka_bootstrap, other, 1, timeout=10)] == [b"7:0:9"]
    assert read_messages(kafka_bootstrap, main, 1, timeout=3) == []
    # a dead letter of a topic no acker of this configuration reads: refused, naming it, nothing sent
    p.produce(dead, key=b"8", value=b"8:0:9", headers=[("reason", b"stranger"), ("source-topic", b"elsewhere-acks")])
    assert p.flush(30) == 0
    from harvester.admin.common import AdminError

    with psycopg.connect(pg_dsn) as conn, pytest.raises(AdminError, match="elsewhere-acks") as refused:
        acks_admin.requeue(cfg, conn, reason="stranger")
    assert refused.value.code == ExitCode.REFUSED
    # the one letter, however slowly a new group joins, then 3 s more to show no second one
    assert len(read_messages(kafka_bootstrap, other, 1, timeout=30, linger=3)) == 1


def test_a_requeue_refuses_dead_letters_larger_than_it_may_hold_and_counts_only_those_chosen(
    pg_dsn, schema, kafka_bootstrap, topics, monkeypatch
):
    """What a partition holds is bounded by count, not by size: past HELD_BYTES_MAX of chosen letters
    the requeue refuses, names the way out, and sends and records nothing; letters it does not choose
    are not held."""
    from confluent_kafka import Producer
    from support.harness import make_config

    from harvester.admin.common import AdminError

    main, dead = topics("acks"), topics("acks-dead")
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, acker={"topic": main, "dead_letter_topic": dead})
    monkeypatch.setattr(acks_admin, "HELD_BYTES_MAX", 1000)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(3):  # 1,800 bytes of values with one reason, one small letter with another
        p.produce(dead, key=b"7", value=b"7:0:9," + b"x" * 600, headers=[("reason", b"big"), ("source-topic", main)])
    p.produce(dead, key=b"8", value=b"8:0:9", headers=[("reason", b"small"), ("source-topic", main)])
    assert p.flush(30) == 0
    for chosen in ("big", None):
        with psycopg.connect(pg_dsn) as conn, pytest.raises(AdminError, match="more than 0 MiB.*--reason") as refused:
            acks_admin.requeue(cfg, conn, reason=chosen)
        assert refused.value.code == ExitCode.REFUSED
    assert read_messages(kafka_bootstrap, main, 1, timeout=3) == [] and _logged(pg_dsn, schema) == []
    with psycopg.connect(pg_dsn) as conn:
        r = acks_admin.requeue(cfg, conn, reason="small")
    assert (r.requeued, r.scanned) == (1, 4)
    assert [m.value() for m in read_messages(kafka_bootstrap, main, 1, timeout=10)] == [b"8:0:9"]


def test_a_console_requeue_holds_no_database_connection_while_it_waits_for_kafka(
    cfg,  # noqa: F811
    dead_letters,
    pg_dsn,
    schema,
    monkeypatch,
):

    held: list[int] = []
    real_select = acks_admin.select

    def select(*args, **kwargs):  # the real read of Kafka, noting the console's checked-out connections
        stats = server.app.fastapi.state.console.db.pool.get_stats()
        held.append(stats["pool_size"] - stats["pool_available"])
        return real_select(*args, **kwargs)

    with RunningServer(cfg, [TOKEN]) as server:
        c = _client(server, TOKEN)
        confirm = c.get("/console/dead-acks/requeue", params={"reason": "out of range"})
        assert confirm.status_code == 200, confirm.text
        monkeypatch.setattr(acks_admin, "select", select)
        data = {"csrf": csrf_of(confirm), "reason": "out of range", "confirm": confirmation_of(confirm)}
        with capture_logs() as logs:
            r = c.post("/console/dead-acks/requeue", data=data)
        assert r.status_code == 200 and "2 dead-lettered acks" in r.text, r.text
    assert held == [0], held
    assert len([e for e in logs if e.get("action") == "acks-requeue"]) == 1, logs  # one audit line
    assert [rows for rows, _ in _logged(pg_dsn, schema)] == [2]  # and one admin_log row


def test_a_requeue_counts_the_headers_of_the_dead_letters_it_holds(
    pg_dsn, schema, kafka_bootstrap, topics, monkeypatch
):
    """A dead letter's headers (its reason, the producer's failure reason) are held with it: letters
    with small values and large headers are refused past HELD_BYTES_MAX as large values are."""
    from confluent_kafka import Producer
    from support.harness import make_config

    from harvester.admin.common import AdminError

    main, dead = topics("acks"), topics("acks-dead")
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, acker={"topic": main, "dead_letter_topic": dead})
    monkeypatch.setattr(acks_admin, "HELD_BYTES_MAX", 1000)
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    for _ in range(3):  # 1,800 bytes of headers, 15 of keys and values
        p.produce(
            dead,
            key=b"7",
            value=b"7:0:9",
            headers=[("reason", b"big"), ("failure-reason", b"y" * 600), ("source-topic", main)],
        )
    assert p.flush(30) == 0
    with psycopg.connect(pg_dsn) as conn, pytest.raises(AdminError, match="nothing was sent") as refused:
        acks_admin.requeue(cfg, conn, reason="big")
    assert refused.value.code == ExitCode.REFUSED
    assert read_messages(kafka_bootstrap, main, 1, timeout=3) == [] and _logged(pg_dsn, schema) == []


def test_a_dead_letter_cut_down_to_fit_is_never_sent_back_as_an_ack(pg_dsn, schema, kafka_bootstrap, topics):
    """The acker cuts a letter the dead-letter topic refuses as too large (its value to 1 KiB,
    header `truncated`): what is left is not the ack it was, so a requeue never sends it."""
    from confluent_kafka import Producer
    from support.harness import make_config

    from harvester.admin.common import AdminError

    main, dead = topics("acks"), topics("acks-dead")
    cfg = make_config(
        pg_dsn, schema, kafka_bootstrap, acker={"topic": main, "dead_letter_topic": dead}, console={"kafka_timeout": 5}
    )
    p = Producer({"bootstrap.servers": kafka_bootstrap})
    cut = [
        ("reason", b"not ASCII"),
        ("source-topic", main.encode()),
        ("truncated", b"value"),
        ("original-size", b"999950"),
    ]
    p.produce(dead, key=b"7", value=b"\xff" * 1024, headers=cut)
    p.produce(
        dead, key=b"7", value=b"7:0:9", headers=[("reason", b"not ASCII either"), ("source-topic", main.encode())]
    )
    assert p.flush(30) == 0
    with psycopg.connect(pg_dsn) as conn, pytest.raises(AdminError, match="cut down") as refused:
        acks_admin.requeue(cfg, conn, at=(0, 0))
    assert refused.value.code == ExitCode.REFUSED
    with psycopg.connect(pg_dsn) as conn:
        assert acks_admin.requeue(cfg, conn, reason="not ASCII").requeued == 1  # the whole one only
    assert [m.value() for m in read_messages(kafka_bootstrap, main, 2, timeout=10, linger=2)] == [b"7:0:9"]
