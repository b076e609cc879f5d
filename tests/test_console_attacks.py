"""The console under attack: cursors no page made, a requeue posted without its confirmation page,
a viewer token revoked while its session lives, and logins from ever new addresses."""

from __future__ import annotations

import httpx
import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.console import csrf_of, login
from support.console_server import VIEWER, cfg, client, server  # noqa: F401 (fixtures)
from support.harness import wait_until
from support.http_server import TOKEN, RunningServer
from support.ports import free_port
from test_admin import add_dead

from harvester.services.console.checks import whole_number
from harvester.services.http.security import RateLimiter
from tracker.ids import ID_MAX


def dead_count(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute(f'SELECT count(*) FROM "{schema}".outbox_dead').fetchone()[0]


def test_cursors_past_the_largest_id_are_answered_not_crashed(server):
    c = client(server, TOKEN)
    for params in (
        {"before": "9999999999999999999"},
        {"view": "open", "before": "9223372036854775808"},
        {"view": "finished", "before": "2026-01-01T00:00:00~9999999999999999999"},
    ):
        r = c.get("/console/batches", params=params)
        assert r.status_code == 200 and "Batches" in r.text, (params, r.status_code, r.text[:300])
    assert c.get("/console/batches", params={"before": "9223372036854775807"}).status_code == 200


def test_a_requeue_needs_the_token_of_its_own_confirmation_page(server, pg_dsn, schema):
    ids = add_dead(pg_dsn, schema, "some-topic", 2, "too large")
    c = client(server, TOKEN)
    csrf = csrf_of(c.get("/console/dead"))
    # The CSRF token alone (any page has it) skips the confirmation: refused, nothing moves.
    for data in ({"all": "1"}, {"reason": "too"}, {"id": str(ids[0])}):
        r = c.post("/console/dead/requeue", data={"csrf": csrf, **data})
        assert r.status_code == 403 and "confirm" in r.text.lower(), (data, r.status_code, r.text[:300])
    assert dead_count(pg_dsn, schema) == 2
    # A confirmation of one row does not stand for every row.
    one = c.get("/console/dead/requeue", params={"id": ids[0]})
    confirm = one.text.split('name="confirm" value="')[1].split('"')[0]
    r = c.post("/console/dead/requeue", data={"csrf": csrf, "confirm": confirm, "all": "1"})
    assert r.status_code == 403 and dead_count(pg_dsn, schema) == 2
    r = c.post("/console/dead/requeue", data={"csrf": csrf, "confirm": confirm, "id": str(ids[0])})
    assert r.status_code == 200 and dead_count(pg_dsn, schema) == 1, r.text[:300]


def test_revoking_a_viewer_token_from_its_file_ends_its_sessions(cfg, tmp_path):  # noqa: F811
    tokens = tmp_path / "viewers.txt"
    other = "another-viewer-token-0123456789"
    tokens.write_text(f"{other}\n")
    cfg.console.viewer_tokens_file = str(tokens)
    with RunningServer(cfg, [TOKEN]) as s:
        c = client(s, other)
        assert c.get("/console/batches").status_code == 200
        tokens.write_text("# nobody\n")
        # The file is looked at once a second, as the tenants file is.
        assert wait_until(lambda: c.get("/console/batches").status_code == 303, 10)
        assert c.get("/console/batches").headers["location"].startswith("/console/login")
        assert login(client(s), other).status_code == 401
        assert client(s, VIEWER).get("/console/batches").status_code == 200  # console.viewer_tokens stay


@settings(max_examples=20, deadline=None)
@given(keys=st.integers(min_value=1, max_value=30_000))
def test_the_rate_limiters_table_stays_bounded_and_a_limited_key_stays_limited(keys):
    now = [0.0]
    limiter = RateLimiter(1.0, 3, clock=lambda: now[0], max_keys=1000)
    for _ in range(3):
        assert limiter.take("guesser") == 0
    assert limiter.take("guesser") > 0
    for i in range(keys):  # ever new source addresses, all within one second
        limiter.take(f"10.{i}")
        assert len(limiter) <= 1000
    assert limiter.take("guesser") > 0 or keys >= 500  # still limited unless pushed out by a flood


def _dead_rows_read(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("SELECT pg_stat_clear_snapshot()")
        row = c.execute(
            "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables "
            "WHERE schemaname = %s AND relname = 'outbox_dead'",
            [schema],
        ).fetchone()
    return int(row[0])


def test_the_dead_rows_page_counts_a_large_dead_table_only_up_to_a_cap(server, cfg, pg_dsn, schema):  # noqa: F811
    from harvester.admin import dead as dead_admin
    from harvester.services.console import queries

    many = 3 * queries.DEAD_COUNT_CAP
    add_dead(pg_dsn, schema, "gone-topic", many, "partition gone")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'VACUUM ANALYZE "{schema}".outbox_dead')
        conn.execute("SELECT pg_stat_force_next_flush()")
    before = _dead_rows_read(pg_dsn, schema)
    with psycopg.connect(pg_dsn) as conn:  # what the dead page reads, on a connection flushed at once
        found = dead_admin.list_dead(conn, schema, "outbox", limit=3, count_cap=queries.DEAD_COUNT_CAP)
        found_reason = dead_admin.list_dead(
            conn, schema, "outbox", reason="gone", limit=3, count_cap=queries.DEAD_COUNT_CAP
        )
        conn.execute("SELECT pg_stat_force_next_flush()")
        conn.commit()
    read = _dead_rows_read(pg_dsn, schema) - before
    assert found.matching == found_reason.matching == queries.DEAD_COUNT_CAP + 1
    assert read <= 3 * queries.DEAD_COUNT_CAP, read  # not twice the 30,000 rows
    c = client(server, TOKEN)
    page = c.get("/console/dead")
    assert page.status_code == 200 and "10,000+" in page.text, page.text[:500]
    assert "Requeue 10,000+ dead rows?" in c.get("/console/dead/requeue", params={"all": "1"}).text


def test_a_tenants_batch_page_lists_no_child_of_another_tenant(server, cfg, pg_dsn, schema):  # noqa: F811
    import tracker

    api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {cfg.tenant_token}"})
    own = api.post("/v1/batches", json={"user_key": "mine"}).json()["batch_id"]
    own_child = api.post("/v1/batches", json={"user_key": "mine-too", "parent": own}).json()["batch_id"]
    with psycopg.connect(pg_dsn) as conn:  # the library speaks for the default tenant
        foreign = tracker.open_batch(conn, user_key="not-yours", parent=own, schema=schema).id
    page = client(server, cfg.tenant_token).get(f"/console/batches/{own}").text
    assert f'href="/console/batches/{own_child}"' in page
    assert f'href="/console/batches/{foreign}"' not in page, page


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example", "localhost.evil.example:8400"])
def test_local_mode_answers_only_requests_addressed_to_a_loopback_name(pg_dsn, schema, kafka_bootstrap, topics, host):
    """Without tokens anyone who reaches the port acts; a web page whose name was rebound to 127.0.0.1
    reaches it from the operator's own browser, as its own origin. Its Host header gives it away."""
    from support.harness import make_config

    c = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"), http={"local_mode": True})
    with RunningServer(c, []) as s:
        web = httpx.Client(base_url=s.url, timeout=60)
        for path in ("/console/", "/console/dead", "/v1/batches/1"):
            r = web.get(path, headers={"Host": host})
            assert r.status_code == 421, (path, host, r.status_code, r.text[:200])
        r = web.post("/v1/batches", json={}, headers={"Host": host})
        assert r.status_code == 421 and "Host" in r.text, r.text[:200]
        for ok in ("127.0.0.1", "localhost:8400", "[::1]:8400", "127.0.0.2"):
            assert web.get("/console/batches", headers={"Host": ok}).status_code == 200, ok
    # The console `reaper run` serves (console.run) has the same gate.
    from harvester.services.console.standalone import ConsoleServer

    c.console.port = free_port()
    alone = ConsoleServer(c).start()
    try:
        web = httpx.Client(base_url=f"http://127.0.0.1:{c.console.port}", timeout=60)
        assert web.get("/console/batches", headers={"Host": host}).status_code == 421
        assert web.get("/console/batches").status_code == 200
    finally:
        alone.stop()


@settings(max_examples=200, deadline=None)
@given(host=st.binary(max_size=80), port=st.integers(min_value=1, max_value=65535), last=st.integers(0, 255))
def test_only_loopback_names_pass_the_local_mode_host_check(host, port, last):
    from harvester.services.http.security import loopback_host

    assert loopback_host(f"127.0.0.{last}:{port}".encode()) and loopback_host(f"[::1]:{port}".encode())
    assert loopback_host(b"LocalHost") and not loopback_host(b"") and not loopback_host(None)
    assert not loopback_host(f"localhost.evil.example:{port}".encode())
    if loopback_host(host):  # whatever passes is localhost or a loopback address, with a port at most
        name = host.decode("latin-1").strip().lower()
        assert name.startswith(("localhost", "127.", "[::1]", "::1", "[0:0:0:0:0:0:0:1]", "0:0")), host


def test_both_requeues_guard_alike_and_a_confirmation_of_one_is_no_confirmation_of_the_other(
    server,  # noqa: F811
    cfg,  # noqa: F811
    pg_dsn,
    schema,
):
    [dead_id] = add_dead(pg_dsn, schema, "some-topic", 1, "too large")
    op, viewer, tenant = client(server, TOKEN), client(server, VIEWER), client(server, cfg.tenant_token)
    csrf = csrf_of(op.get("/console/dead"))
    dead_confirm = op.get("/console/dead/requeue", params={"id": dead_id})
    dead_token = dead_confirm.text.split('name="confirm" value="')[1].split('"')[0]
    for flow, target in (("dead", {"id": str(dead_id)}), ("dead-acks", {"at": "0:0"})):
        url = f"/console/{flow}/requeue"
        assert op.get(url).status_code == 400, flow  # no target named
        assert op.post(url, data={"csrf": csrf}).status_code == 400, flow
        assert tenant.get(url, params=target).status_code == 403, flow
        r = tenant.post(url, data={"csrf": csrf_of(tenant.get("/console/batches")), **target})
        assert r.status_code == 403 and "only operators" in r.text, (flow, r.text[:300])
        r = viewer.post(url, data={"csrf": csrf_of(viewer.get("/console/batches")), **target})
        assert r.status_code == 403 and "may only look" in r.text, (flow, r.text[:300])
        for confirm in (None, "forged", dead_token if flow == "dead-acks" else "x"):
            data = {"csrf": csrf, **target, **({"confirm": confirm} if confirm else {})}
            r = op.post(url, data=data)
            assert r.status_code == 403 and "confirmation page" in r.text, (flow, confirm, r.text[:300])
    assert dead_count(pg_dsn, schema) == 1


def test_every_console_answer_carries_the_security_headers(server, cfg):  # noqa: F811
    """Pages, fragments, static files, refusals, redirects and not-found answers alike: none may be
    framed or sniffed as another type."""
    anon, viewer, tenant = client(server), client(server, VIEWER), client(server, cfg.tenant_token)
    answers = {
        "login": login(client(server), TOKEN),
        "a tenant sent from the overview to its batches": tenant.get("/console/"),
        "login form": anon.get("/console/login"),
        "redirect to login": anon.get("/console/batches"),
        "overview": viewer.get("/console/"),
        "fragment": viewer.get("/console/fragments/overview"),
        "static file": viewer.get("/console/static/console.css"),
        "unknown static file": viewer.get("/console/static/nope.js"),
        "unknown batch": viewer.get("/console/batches/987654321"),
        "bad cursor": viewer.get("/console/batches/1?after=x"),
        "action without its csrf token": viewer.post("/console/batches/1/expire", data={}),
        "console root": anon.get("/console", follow_redirects=False),
        "logout": client(server, VIEWER).post("/console/logout", data={}),
    }
    missing = {
        what: r.status_code
        for what, r in answers.items()
        if r.headers.get("x-content-type-options") != "nosniff"
        or "frame-ancestors 'none'" not in r.headers.get("content-security-policy", "")
    }
    assert missing == {}


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(max_size=24), st.integers(-5, 1 << 64).map(str), st.integers(0, 10**6).map(lambda n: f"0{n}")))
def test_an_id_in_a_console_url_is_read_only_as_the_api_writes_it(text):
    # one batch, one URL: '01', ' 1', '+1', '١' (an Arabic-Indic one) name nothing, as in the API
    read = whole_number(text)
    assert read is None or str(read) == text
    if read is None and text.isascii() and text.isdigit() and (text == "0" or text[0] != "0"):
        assert int(text) > ID_MAX  # only a canonical decimal past the largest id is refused


def test_a_batch_named_with_a_leading_zero_is_no_batch(server, pg_dsn, schema):
    c = client(server, TOKEN)
    with psycopg.connect(pg_dsn) as conn:
        batch = conn.execute(f'SELECT "{schema}".open_batch()').fetchone()[0]
    assert c.get(f"/console/batches/{batch}").status_code == 200
    for written in (f"0{batch}", f"00{batch}", f"%20{batch}", f"+{batch}"):
        assert c.get(f"/console/batches/{written}").status_code == 404, written
        assert c.get(f"/console/batches/{written}/expire").status_code == 404, written
