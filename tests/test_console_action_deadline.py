"""A console action that runs past http.request_timeout (a requeue of every dead row commits in
chunks) cannot be stopped once started: the page says it is still running and where its outcome
will be, never "Database unavailable", and the action goes on to its end, audited once."""

from __future__ import annotations

import time

import httpx
import psycopg
from structlog.testing import capture_logs
from support.console import confirmation_of, csrf_of, login
from support.http_server import TOKEN, RunningServer, http_config
from test_admin import add_dead


def _dead(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT count(*) FROM "{schema}".outbox_dead').fetchone()[0]


def test_a_requeue_of_every_dead_row_past_the_deadline_says_it_is_still_running(pg_dsn, schema):
    add_dead(pg_dsn, schema, "t-dead", 150_000, "MSG_SIZE_TOO_LARGE")
    cfg = http_config(pg_dsn, schema, request_timeout=1.0)
    with RunningServer(cfg, [TOKEN]) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        assert login(c, TOKEN).status_code == 303
        confirm = c.get("/console/dead/requeue", params={"all": "1"})
        assert confirm.status_code == 200, confirm.text[:300]
        with capture_logs() as logs:
            r = c.post(
                "/console/dead/requeue",
                data={"csrf": csrf_of(confirm), "confirm": confirmation_of(confirm), "all": "1"},
            )
            left_at_answer = _dead(pg_dsn, schema)
            deadline = time.monotonic() + 120
            while _dead(pg_dsn, schema) and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(0.5)  # its audit line follows its last commit
    assert r.status_code != 503 and "Database unavailable" not in r.text, (r.status_code, r.text[:300])
    if left_at_answer:  # it outlived the page (the usual case): the page says so
        assert r.status_code == 202 and "Still running" in r.text and "dead-requeue" in r.text, r.text[:500]
    assert _dead(pg_dsn, schema) == 0
    audit = [(e["outcome"], e.get("moved")) for e in logs if e.get("action") == "dead-requeue"]
    assert audit == [("done", 150_000)], audit
