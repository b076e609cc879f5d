"""The console's database calls: each answers within http.request_timeout, on the console's own
threads, and a database that is down or holds a lock gets a 503 page (Retry-After), like the API's
503, never a 500; the API keeps answering meanwhile."""

from __future__ import annotations

import threading

import httpx
import psycopg
from support.console import login
from support.http_server import TOKEN, RunningServer, http_config
from support.ports import free_port

from harvester.services.console.web import Db

REQUEST_TIMEOUT = 2.0
HELD = 30.0  # how long a test's lock is held at most: well past any deadline of the server


class HeldLock:
    """An ACCESS EXCLUSIVE lock on one table (a migration, a VACUUM FULL), released on exit or after HELD s."""

    def __init__(self, dsn: str, table: str) -> None:
        self.conn = psycopg.connect(dsn)
        self.conn.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._timer = threading.Timer(HELD, self.release)
        self._timer.start()

    def release(self) -> None:
        with self._lock:
            if not self.released.is_set():
                self.conn.rollback()
                self.conn.close()
                self.released.set()

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self.release()


def test_a_console_connection_has_the_request_timeout_as_its_statement_and_lock_timeouts(pg_dsn, schema):
    db = Db(http_config(pg_dsn, schema, request_timeout=2.5))
    db.open()
    try:
        got = db.pool.getconn()
        try:
            settings = got.execute("SELECT current_setting('statement_timeout'), current_setting('lock_timeout')")
            assert settings.fetchone() == ("2500ms", "2500ms")
        finally:
            db.pool.putconn(got)
    finally:
        db.close()


def test_a_page_waiting_on_a_lock_answers_503_while_the_lock_is_held_and_the_api_answers(pg_dsn, schema):
    cfg = http_config(pg_dsn, schema, request_timeout=REQUEST_TIMEOUT)
    with RunningServer(cfg, [TOKEN]) as s:
        api = httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        b = api.post("/v1/batches", json={}).json()["batch_id"]
        api.post(f"/v1/batches/{b}/items", json={"count": 3000})
        console = httpx.Client(base_url=s.url, timeout=60)
        assert login(console, TOKEN).status_code == 303
        assert console.get("/console/batches").status_code == 200

        # Every signed-in page first reads the logout table: locked, every page waits on it.
        with HeldLock(pg_dsn, f'"{schema}".console_logout') as lock:
            pages: list[tuple[int, bool]] = []

            def page() -> None:
                r = console.get("/console/batches")
                pages.append((r.status_code, lock.released.is_set()))

            threads = [threading.Thread(target=page, daemon=True) for _ in range(8)]
            for t in threads:
                t.start()
            # an ack large enough to be folded off the event loop, while the pages wait
            r = api.post("/v1/acks", json={"ids": [f"{b}:0:{i}" for i in range(3000)]})
            acked_while_locked = not lock.released.is_set()
            for t in threads:
                t.join(timeout=HELD + 10)
        assert r.status_code == 200 and acked_while_locked, (r.status_code, r.text[:200])
        assert len(pages) == 8
        assert all(code == 503 and not released for code, released in pages), pages


def test_a_page_with_the_database_down_is_a_503_page_not_a_500(schema):
    port = free_port()  # nothing listens there
    dsn = f"postgresql://postgres@127.0.0.1:{port}/outbox?connect_timeout=1"
    cfg = http_config(dsn, schema, request_timeout=1.0)
    with RunningServer(cfg, [TOKEN]) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert login(c, TOKEN).status_code == 303  # signing in needs no database
        for path in ("/console/batches", "/console/", "/console/fragments/overview"):
            page = c.get(path)
            assert page.status_code == 503, (path, page.status_code, page.text[:300])
            assert page.headers["Retry-After"] == "1"
            assert page.headers["content-type"].startswith("text/html")
            assert "Traceback" not in page.text and "internal" not in page.text.lower()
