"""The operator's console served by the HTTP service, through a real server and client, on real
Postgres and Kafka: logging in, roles, CSRF, tenants, pages with real data, and the two actions
(requeue a dead row, expire a batch) going through the admin commands' code."""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import uuid

import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.console import confirmation_of, csrf_of, login
from support.harness import Receiver, make_config, running, wait_until
from support.http_server import TOKEN, RunningServer
from support.ports import free_port
from test_admin import add_dead

import tracker
from harvester.services.http.tenants import new_token

VIEWER = "viewer-token-0123456789abcdef"


@pytest.fixture
def cfg(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    tenant_token, digest = new_token()
    tenants = tmp_path / "tenants.yml"
    tenants.write_text(f"tenants:\n  billing:\n    tokens: ['{digest}']\n")
    c = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=topics("leader"),
        http={"tenants_file": str(tenants), "completion_poll_interval": 0.05},
        acker={"topic": topics("acks"), "dead_letter_topic": topics("acks-dead")},
        console={"viewer_tokens": VIEWER, "page_size": 3, "refresh_interval": 0.5, "kafka_timeout": 5},
    )
    c.tenant_token = tenant_token  # type: ignore[attr-defined]
    return c


@pytest.fixture
def server(cfg):
    with RunningServer(cfg, [TOKEN]) as s:
        yield s


@pytest.fixture
def viewer(server):
    return client(server, VIEWER)


def client(server, token: str | None = None) -> httpx.Client:
    c = httpx.Client(base_url=server.url, timeout=60)
    if token is not None:
        r = login(c, token)
        assert r.status_code == 303, r.text
    return c


def state_of(pg_dsn: str, schema: str, batch_id: int) -> str:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT state FROM "{schema}".batch WHERE id = %s', [batch_id]).fetchone()[0]


def test_pages_need_a_login_and_a_valid_token(server):
    anon = client(server)
    for path in ("/console/", "/console/batches", "/console/batches/1", "/console/dead"):
        r = anon.get(path)
        assert r.status_code == 303 and r.headers["location"].startswith("/console/login?next="), (path, r.text)
    # A live fragment is not sent to the login page (its page reloads): no login cookie behind the user's back.
    for path in ("/console/fragments/overview", "/console/fragments/batches", "/console/fragments/batches/1"):
        r = anon.get(path)
        assert r.status_code == 401 and "location" not in r.headers and "set-cookie" not in r.headers, (path, r.text)
        assert r.headers["cache-control"] == "no-store" and r.headers["x-frame-options"] == "DENY"
    assert anon.get("/console/login").headers["content-security-policy"].startswith("default-src 'self'")
    r = login(anon, "not-a-token-at-all-0000000")
    assert r.status_code == 401 and "not valid" in r.text and "reaper_console" not in r.cookies
    # The login form's own nonce is required (a form posted from elsewhere is refused).
    r = anon.post("/console/login", data={"token": TOKEN, "nonce": "forged", "next": "/console/"})
    assert r.status_code == 403 and "reaper_console" not in r.cookies
    # After login, only a path of the console: never another site.
    c = client(server)
    c.get("/console/login")
    r = c.post(
        "/console/login",
        data={"token": TOKEN, "nonce": c.cookies.get("reaper_console_login"), "next": "//evil.example/"},
    )
    assert r.status_code == 303 and r.headers["location"] == "/console/"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console/" in cookie
    # A tampered cookie is no session.
    value = c.cookies.get("reaper_console")
    forged = httpx.Client(base_url=server.url, cookies={"reaper_console": value[:-2] + "xx"})
    assert forged.get("/console/").status_code == 303


def test_a_viewer_reads_but_cannot_act_and_every_post_needs_the_csrf_token(server, cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 3, schema=schema)
    [dead_id] = add_dead(pg_dsn, schema, "some-topic", 1, "too large")
    viewer = client(server, VIEWER)
    page = viewer.get(f"/console/batches/{b.id}")
    assert page.status_code == 200 and "Expire this batch" not in page.text
    assert "Requeue" not in viewer.get("/console/dead").text
    for path in (
        f"/console/dead/requeue?id={dead_id}",
        "/console/dead/requeue?all=1",
        f"/console/batches/{b.id}/expire",
    ):
        r = viewer.get(path)  # the first step of an action is not a viewer's either
        assert r.status_code == 403 and "may only look" in r.text and 'name="confirm"' not in r.text, path
    token = csrf_of(page)
    with capture_logs() as logs:
        r = viewer.post(f"/console/batches/{b.id}/expire", data={"csrf": token, "note": "x"})
        assert r.status_code == 403 and "may only look" in r.text
        r = viewer.post("/console/dead/requeue", data={"csrf": token, "id": str(dead_id)})
        assert r.status_code == 403
    assert not [e for e in logs if e.get("action")], logs  # nothing was attempted
    operator = client(server, TOKEN)
    for data in ({"note": "x"}, {"csrf": "wrong", "note": "x"}, {"csrf": token, "note": "x"}):  # the viewer's token
        r = operator.post(f"/console/batches/{b.id}/expire", data=data)
        assert r.status_code == 403 and "CSRF" in r.text, data
    r = client(server).post(f"/console/batches/{b.id}/expire", data={"csrf": token})
    assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
    assert state_of(pg_dsn, schema, b.id) == "open"
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT count(*) FROM "{schema}".outbox_dead').fetchone()[0] == 1


def test_pages_show_real_data_with_thousands_separators_and_keyset_pages(server, cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, value) SELECT %s, %s FROM generate_series(1, 1234)', ["t", b"v"]
        )
        parent = tracker.open_batch(conn, user_key="catalog-7", schema=schema)
        tracker.add_items(conn, parent, 12345, schema=schema)
        tracker.ack(conn, [f"{parent.id}:0:0-99"], schema=schema, claims=False)
        tracker.fail(conn, [f"{parent.id}:0:100"], "image missing", schema=schema)
        child = tracker.open_batch(conn, parent=parent, schema=schema)
        done = tracker.open_batch(conn, user_key="done-1", schema=schema)
        tracker.close_batch(conn, done, schema=schema)
        more = [tracker.open_batch(conn, schema=schema).id for _ in range(4)]
    c = client(server, TOKEN)
    overview = c.get("/console/")
    assert overview.status_code == 200
    # 1,234 rows and the completion event of `done`
    assert re.search(r'data-figure="backlog">1,235 rows', overview.text), overview.text
    assert "default" in overview.text and "Acker lag" in overview.text
    fragment = c.get("/console/fragments/overview")
    assert fragment.status_code == 200 and "<html" not in fragment.text and "1,235" in fragment.text

    found = c.get("/console/batches", params={"q": "catalog-7"}).text
    assert f'data-batch="{parent.id}"' in found and "100 acked, 1 failed, 12,244 pending of 12,345" in found
    assert f'data-batch="{done.id}"' in c.get("/console/batches", params={"q": str(done.id)}).text
    assert f'data-batch="{done.id}"' in c.get("/console/batches", params={"view": "finished"}).text

    page = c.get(f"/console/batches/{parent.id}").text
    assert "image missing" in page and f"{parent.id}:0:101-" in page and f"/console/batches/{child.id}" in page
    assert "12,345" in page and "Not yet" in page
    assert "Written to the outbox" in c.get(f"/console/batches/{done.id}").text

    # Keyset pages (3 rows each) walk every unfinished batch exactly once, newest first.
    seen, url = [], "/console/batches?view=unfinished"
    while url:
        r = c.get(url)
        seen += [int(x) for x in re.findall(r'data-batch="(\d+)"', r.text)]
        nxt = re.search(r'rel="next" href="([^"]+)"', r.text)
        url = nxt.group(1).replace("&amp;", "&") if nxt else ""
    assert seen == sorted([parent.id, child.id, *more], reverse=True)
    for bad in ("/console/batches?view=nope", "/console/batches?before=1;drop", "/console/batches/1?after=x"):
        assert c.get(bad).status_code == 400, bad
    assert c.get("/console/batches/987654321").status_code == 404


def test_a_tenant_sees_only_its_own_batches_and_no_outbox_page(server, cfg, pg_dsn, schema):
    api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {cfg.tenant_token}"})
    own = api.post("/v1/batches", json={"user_key": "mine"}).json()["batch_id"]
    with psycopg.connect(pg_dsn) as conn:
        other = tracker.open_batch(conn, user_key="mine", schema=schema).id
    t = client(server, cfg.tenant_token)
    r = t.get("/console/")
    assert r.status_code == 303 and r.headers["location"] == "/console/batches"
    listed = t.get("/console/batches").text
    assert f'data-batch="{own}"' in listed and f'data-batch="{other}"' not in listed
    searched = t.get("/console/batches", params={"q": "mine"}).text
    assert f'data-batch="{own}"' in searched and f'data-batch="{other}"' not in searched
    assert t.get(f"/console/batches/{other}").status_code == 404
    assert t.get("/console/dead").status_code == 403
    token = csrf_of(t.get(f"/console/batches/{own}"))
    assert t.post(f"/console/batches/{other}/expire", data={"csrf": token}).status_code == 404
    assert state_of(pg_dsn, schema, other) == "open"


def _posts(logs: list[dict]) -> list[dict]:
    """The access lines of the expiry POSTs (a line of a request made before the capture, as the
    login, can still arrive within it)."""
    return [
        e
        for e in logs
        if e.get("event") == "http request" and e.get("method") == "POST" and str(e.get("path")).endswith("/expire")
    ]


def test_expire_from_the_console_is_the_admin_command_with_an_audit_line(server, cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, user_key="stuck", schema=schema)
        tracker.add_items(conn, b, 5, schema=schema)
        complete = tracker.open_batch(conn, schema=schema)
        tracker.close_batch(conn, complete, schema=schema)
    c = client(server, TOKEN)
    confirm = c.get(f"/console/batches/{b.id}/expire")
    assert confirm.status_code == 200 and f"Expire batch {b.id}" in confirm.text
    token = csrf_of(confirm)
    with capture_logs() as logs:
        r = c.post(f"/console/batches/{b.id}/expire", data={"csrf": token, "note": "consumer gone"})
        assert r.status_code == 200 and f"batch {b.id} expired (5 of 5 items pending)" in r.text, r.text
        again = c.post(f"/console/batches/{b.id}/expire", data={"csrf": token})
        assert again.status_code == 200 and "already expired" in again.text
        refused = c.post(f"/console/batches/{complete.id}/expire", data={"csrf": token})
        assert refused.status_code == 409 and "complete" in refused.text
        # The access line is written once the response is sent, so the client can read the
        # response first: wait for the third one before leaving the capture.
        wait_until(lambda: len(_posts(logs)) >= 3, timeout=10)
    audit = [e for e in logs if e.get("action") == "batch-expire"]
    assert [(e["outcome"], e["batch_id"], e["role"], e["token"].startswith("tok-")) for e in audit] == [
        ("done", b.id, "operator", True),
        ("done", b.id, "operator", True),
        ("refused", complete.id, "operator", True),
    ]
    # The access log names who acted too, as it does for the pages they looked at.
    posts = _posts(logs)
    assert [(e["status"], (e["token"] or "").startswith("tok-")) for e in posts] == [
        (200, True),
        (200, True),
        (409, True),
    ], posts
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT action, rows FROM "{schema}".admin_log').fetchall() == [("batch-expire", 1)]
        values = [r[0] for r in conn.execute(f'SELECT value FROM "{schema}".outbox ORDER BY id').fetchall()]
    events = [json.loads(v) for v in values]
    expired = [e for e in events if e.get("event") == "expired"]  # the other: `complete`'s completion
    assert [(e["batch_id"], e["reason"], e["note"]) for e in expired] == [(b.id, "operator", "consumer gone")]


def test_requeue_from_the_console_republishes_a_dead_row_once(server, cfg, pg_dsn, schema, topics, kafka_bootstrap):
    topic = topics("data")
    ids = add_dead(pg_dsn, schema, topic, 3, "operator-test: partition gone")
    other = add_dead(pg_dsn, schema, topic, 2, "too large", prefix="big")
    c = client(server, TOKEN)
    listed = c.get("/console/dead").text  # pages of 3
    nxt = re.search(r'rel="next" href="([^"]+)"', listed)
    assert nxt and "5 </span>" not in listed and ">5</span>" in listed.replace(" ", ""), listed
    listed += c.get(nxt.group(1).replace("&amp;", "&")).text
    assert all(listed.count(f'data-dead="{i}"') == 1 for i in ids + other)
    inspected = c.get(f"/console/dead/{ids[0]}").text
    assert "operator-test: partition gone" in inspected and "dead-1" in inspected and "0x00ff" in inspected
    confirm = c.get("/console/dead/requeue", params={"id": ids[0]})
    assert "Requeue 1 dead row?" in confirm.text
    token, one = csrf_of(confirm), confirmation_of(confirm)
    confirm_reason = c.get("/console/dead/requeue", params={"reason": "too large"})
    assert "Requeue 2 dead rows?" in confirm_reason.text
    receiver = Receiver(kafka_bootstrap, topic)
    try:
        with capture_logs() as logs:
            r = c.post("/console/dead/requeue", data={"csrf": token, "confirm": one, "id": str(ids[0])})
            assert r.status_code == 200 and "requeued 1 rows" in r.text, r.text
            again = c.post("/console/dead/requeue", data={"csrf": token, "confirm": one, "id": str(ids[0])})
            assert again.status_code == 409 and "nothing was requeued" in again.text
            by_reason = c.post(
                "/console/dead/requeue",
                data={"csrf": token, "confirm": confirmation_of(confirm_reason), "reason": "too large"},
            )
            assert by_reason.status_code == 200 and "requeued 2 rows" in by_reason.text
        with running(cfg):
            assert wait_until(lambda: len(receiver.records) >= 3, 30)
            time.sleep(1.0)  # anything published twice would arrive by now
    finally:
        receiver.close()
    assert sorted(receiver.values()) == [b"big-1", b"big-2", b"dead-1"]
    audit = [(e["outcome"], e.get("moved")) for e in logs if e.get("action") == "dead-requeue"]
    assert audit == [("done", 1), ("refused", None), ("done", 2)]
    with psycopg.connect(pg_dsn) as conn:
        left = [r[0] for r in conn.execute(f'SELECT id FROM "{schema}".outbox_dead ORDER BY id').fetchall()]
        logged = conn.execute(f'SELECT action, rows FROM "{schema}".admin_log ORDER BY id').fetchall()
    assert left == ids[1:] and logged == [("dead-requeue", 1), ("dead-requeue", 2)]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(max_size=40),
    where=st.sampled_from(
        [
            ("/console/batches", "q"),
            ("/console/dead", "reason"),
            ("/console/batches", "before"),
            ("/console/dead", "after"),
        ]
    ),
)
def test_any_query_text_is_answered_not_crashed(viewer, where, text):
    path, name = where
    r = viewer.get(path, params={name: text})
    assert r.status_code in (200, 400), (text, r.status_code, r.text[:300])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(csrf=st.text(max_size=60), nonce=st.text(max_size=30), cookie=st.text(max_size=60))
def test_any_form_or_cookie_text_is_refused_not_crashed(server, viewer, csrf, nonce, cookie):
    r = viewer.post("/console/dead/requeue", data={"csrf": csrf, "all": "1"})
    assert r.status_code == 403, r.text[:300]
    anon = httpx.Client(base_url=server.url, cookies={"reaper_console_login": "n0nce"})
    r = anon.post("/console/login", data={"token": TOKEN, "nonce": nonce, "next": "/console/"})
    assert r.status_code in (303, 403, 429) and (r.status_code != 303 or nonce == "n0nce"), r.text[:300]
    safe = "".join(ch for ch in cookie if " " < ch < "\x7f" and ch != ";")  # what a header can carry
    r = httpx.Client(base_url=server.url).get("/console/", headers={"Cookie": f"reaper_console={safe}"})
    assert r.status_code == 303, r.text[:300]


def test_reaper_run_serves_the_console_when_configured(cfg, tmp_path):
    from support.harness import env_for
    from support.reaper import ReaperProcess, stop_all

    port = free_port()
    env = env_for(cfg) | {
        "REAPER_CONSOLE__RUN": "true",
        "REAPER_CONSOLE__PORT": str(port),
        "REAPER_HTTP__TOKENS": TOKEN,
        "REAPER_CONSOLE__VIEWER_TOKENS": VIEWER,
    }
    proc = ReaperProcess(env, tmp_path / "reaper.log")
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)

        def up() -> bool:
            try:
                return c.get("/console/login").status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, 60), (tmp_path / "reaper.log").read_text()
        assert c.get("/console/").status_code == 303
        assert login(c, VIEWER).status_code == 303
        overview = c.get("/console/")
        assert overview.status_code == 200 and 'data-unit="default"' in overview.text
        assert c.get("/v1/batches/1").status_code == 404  # the console only: the API is `reaper serve`'s
    finally:
        stop_all([proc])
    assert proc.proc.returncode == 0, (tmp_path / "reaper.log").read_text()


def test_dead_lettered_acks_are_listed_newest_first_with_their_reasons(server, cfg, pg_dsn, schema, kafka_bootstrap):
    from support.acking import make_acker, produce_raw
    from support.acking import running as acker_running

    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 2, schema=schema)
    a = cfg.acker
    produce_raw(kafka_bootstrap, a.topic, [(b"1", b"not-an-id"), (str(b.id).encode(), f"{b.id}:0:9".encode())])
    acker = make_acker(pg_dsn, schema, kafka_bootstrap, a.topic, a.dead_letter_topic)
    with acker_running(acker):
        assert wait_until(lambda: acker.stats["dead_lettered"] == 2, 60), acker.stats
    c = client(server, TOKEN)
    page = c.get("/console/dead-acks")
    assert page.status_code == 200 and "not-an-id" in page.text and f"{b.id}:0:9" in page.text, page.text
    assert page.text.count("data-dead-ack=") == 2 and 'class="hint">2 in <code>' in page.text
    reasons = re.findall(r"<td>([^<]*)</td>", page.text)
    assert reasons[0] == "index out of range (group size 2)" and reasons[1].startswith("malformed"), reasons
    assert client(server, VIEWER).get("/console/dead-acks").status_code == 200
    assert client(server, cfg.tenant_token).get("/console/dead-acks").status_code == 403


def test_a_cookie_used_after_logout_is_refused_by_every_server(cfg, pg_dsn, schema):
    cfg.console.session_secret = "shared-session-secret-0123456789abcdef"  # two servers behind one address
    with RunningServer(cfg, [TOKEN]) as a, RunningServer(cfg, [TOKEN]) as b:
        c = client(a, TOKEN)
        cookie = c.cookies.get("reaper_console")
        copied = {"reaper_console": cookie}
        assert httpx.Client(base_url=b.url, cookies=copied).get("/console/batches").status_code == 200
        token = csrf_of(c.get("/console/batches"))
        with capture_logs() as logs:
            r = c.post("/console/logout", data={"csrf": token})
        assert r.status_code == 303 and r.headers["location"] == "/console/login"
        assert [e for e in logs if e["event"] == "logout"], logs
        for server in (a, b):
            copy = httpx.Client(base_url=server.url, cookies=copied)
            r = copy.get("/console/batches")
            assert r.status_code == 303 and r.headers["location"].startswith("/console/login"), server.url
            r = copy.post("/console/batches/1/expire", data={"csrf": token, "note": "x"})
            assert r.status_code == 303 and r.headers["location"].startswith("/console/login")
        # A new login is a new session: it works at once.
        assert client(b, TOKEN).get("/console/batches").status_code == 200


def test_the_overviews_acker_lag_covers_every_schemas_ack_topic(kafka_bootstrap, topics, pg_dsn, schema):
    from confluent_kafka import Producer

    from harvester import config as config_mod
    from harvester.services.console.overview import acker_lag

    main_acks, other_acks = topics("acks-main"), topics("acks-other")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for topic, n in ((main_acks, 3), (other_acks, 2)):
        for i in range(n):
            producer.produce(topic, value=f"1:0:{i}".encode())
    assert producer.flush(30) == 0
    cfg = config_mod.load(
        None,
        environ={},
        overrides={
            "database": {"dsn": pg_dsn, "schema": schema},
            "kafka": {"bootstrap_servers": kafka_bootstrap},
            "acker": {"topic": main_acks, "group": f"acker-{uuid.uuid4().hex[:8]}"},
            "harvester": {
                "outboxes": [{"name": "main"}, {"name": "other", "schema": "other", "ack_topic": other_acks}]
            },
        },
    )
    assert acker_lag(cfg, 10) == 5  # nothing committed by either acker group yet
    # retention deleted the first two of main's: the acker group starts from the earliest left
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.delete_records([TopicPartition(main_acks, 0, 2)]).values():
        f.result(30)
    assert acker_lag(cfg, 10) == 1 + 2
    # a committed offset past the end (the topic made anew under the same name): from the earliest
    from confluent_kafka import Consumer

    from harvester.config_outboxes import acker_group

    group = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": acker_group(cfg, other_acks)})
    group.commit(offsets=[TopicPartition(other_acks, 0, 50)], asynchronous=False)
    group.close()
    assert acker_lag(cfg, 10) == 1 + 2


def test_a_field_given_twice_is_read_the_same_way_by_the_confirmation_page_and_the_action(server, pg_dsn, schema):
    """`id=A&id=B`: the page and the form both mean B (the last), so what was confirmed is what is done."""
    first, second = add_dead(pg_dsn, schema, "some-topic", 2, "too large")
    c = client(server, TOKEN)
    confirm = c.get(f"/console/dead/requeue?id={first}&id={second}")
    assert confirm.status_code == 200 and "Requeue 1 dead row?" in confirm.text
    assert f"Dead row {second} (" in confirm.text and f"Dead row {first} (" not in confirm.text, confirm.text
    form = [("csrf", csrf_of(confirm)), ("confirm", confirmation_of(confirm)), ("id", str(first)), ("id", str(second))]
    r = c.post(
        "/console/dead/requeue",
        content=urllib.parse.urlencode(form),
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and "requeued 1 rows" in r.text, r.text
    with psycopg.connect(pg_dsn) as conn:
        left = [row[0] for row in conn.execute(f'SELECT id FROM "{schema}".outbox_dead').fetchall()]
    assert left == [first]
