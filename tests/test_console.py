"""The operator's console served by the HTTP service, through a real server and client, on real
Postgres and Kafka: who gets in (a login, a valid token, a session not logged out on any server),
what a viewer and a tenant may see and do, CSRF on every post, any form or cookie text refused
without a crash, and `reaper run` serving it when configured. Pages: test_console_pages.py;
actions: test_console_actions.py."""

from __future__ import annotations

import httpx
import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.console import csrf_of, login
from support.console_server import VIEWER, cfg, client, server, state_of, viewer  # noqa: F401  (fixtures)
from support.harness import wait_until
from support.http_server import TOKEN, RunningServer
from support.ports import free_port
from test_admin import add_dead

import tracker


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
