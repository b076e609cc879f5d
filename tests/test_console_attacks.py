"""The console under attack: cursors no page made, a requeue posted without its confirmation page,
a viewer token revoked while its session lives, and logins from ever new addresses."""

from __future__ import annotations

import psycopg
from hypothesis import given, settings
from hypothesis import strategies as st
from support.console import login
from support.harness import wait_until
from support.http_server import TOKEN, RunningServer
from test_admin import add_dead
from test_console import VIEWER, cfg, client, csrf_of, server  # noqa: F401 (fixtures)

from harvester.services.http.security import RateLimiter


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
