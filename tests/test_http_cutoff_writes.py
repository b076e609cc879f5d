"""A write cut off at http.request_timeout after it reached the database may have committed: its
503 says so and that a retry with the same Idempotency-Key applies it at most once, and its audit
line says outcome unknown. Here the database commits and its answer is lost on the way back (a
network hiccup): the retry with the key replays the stored answer, and the items count once."""

from __future__ import annotations

import socket
import threading

import httpx
import psycopg
import pytest
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from support.http_server import TOKEN, RunningServer, http_config


class MutingProxy:
    """Forwards TCP both ways; a connection that sends `marker` while armed gets no more answers."""

    def __init__(self, upstream: tuple[str, int], marker: bytes) -> None:
        self.upstream, self.marker, self.armed = upstream, marker, False
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.srv.close()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            u = socket.create_connection(self.upstream)
            muted = threading.Event()
            threading.Thread(target=self._pipe, args=(c, u, muted, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(u, c, muted, False), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, muted: threading.Event, up: bool) -> None:
        try:
            while data := a.recv(65536):
                if up and self.armed and self.marker in data:
                    muted.set()
                if up or not muted.is_set():
                    b.sendall(data)
        except OSError:
            pass


@pytest.mark.parametrize("backend", ["tracker", "sql"])
def test_a_write_committed_but_cut_off_is_unknown_and_its_keyed_retry_applies_once(pg_dsn, schema, backend):
    params = conninfo_to_dict(pg_dsn)
    proxy = MutingProxy((str(params.get("host", "127.0.0.1")), int(params.get("port", 5432))), b"COMMIT")
    dsn = make_conninfo(pg_dsn, host="127.0.0.1", port=str(proxy.port))
    cfg = http_config(dsn, schema, request_timeout=1.0, backend=backend)
    key = {"Idempotency-Key": '"cut-off-1"'}
    try:
        with (
            RunningServer(cfg, [TOKEN]) as s,
            httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c,
        ):
            batch = c.post("/v1/batches", json={}).json()["batch_id"]
            with structlog.testing.capture_logs() as logs:
                proxy.armed = True  # the keyed write's transaction commits; its answer never comes back
                first = c.post(f"/v1/batches/{batch}/items", json={"count": 5}, headers=key)
                proxy.armed = False
                retry = c.post(f"/v1/batches/{batch}/items", json={"count": 5}, headers=key)
    finally:
        proxy.close()
    with psycopg.connect(pg_dsn) as conn:
        (total,) = conn.execute(f'SELECT total FROM "{schema}".batch WHERE id = %s', [batch]).fetchone()
    assert first.status_code == 503, first.text
    assert "may have been applied" in first.json()["detail"] and "Idempotency-Key" in first.json()["detail"]
    assert retry.status_code == 200, retry.text
    assert total == 5  # applied once, whatever the first answer said
    audits = [(a["status"], a["outcome"]) for a in logs if a.get("event") == "audit"]
    assert audits[0] == (503, "unknown"), audits
    assert audits[1][1] in ("replayed", "applied"), audits
