"""A write cut off at http.request_timeout after it reached the database may have committed: its
503 says so and that a retry with the same Idempotency-Key applies it at most once, and its audit
line says outcome unknown. Here the database commits and its answer is lost on the way back (a
network hiccup): the retry with the key replays the stored answer, and the items count once."""

from __future__ import annotations

import socket

import httpx
import psycopg
import pytest
import structlog
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from support.http_server import TOKEN, RunningServer, http_config
from support.tcp_proxy import TcpProxy


class MutingProxy(TcpProxy):
    """Forwards TCP both ways; a connection whose client sends `marker` while armed gets no more
    answers (what the client sent still reaches the server)."""

    def __init__(self, upstream: str, marker: bytes) -> None:
        self.marker, self.armed, self._muted = marker, False, set()
        super().__init__(upstream)

    def _pump(self, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
        client = dst if from_upstream else src
        try:
            while data := src.recv(65536):
                if not from_upstream and self.armed and self.marker in data:
                    self._muted.add(client)
                if not from_upstream or client not in self._muted:
                    dst.sendall(data)
        except OSError:
            pass


@pytest.mark.parametrize("backend", ["tracker", "sql"])
def test_a_write_committed_but_cut_off_is_unknown_and_its_keyed_retry_applies_once(pg_dsn, schema, backend):
    params = conninfo_to_dict(pg_dsn)
    proxy = MutingProxy(f"{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}", b"COMMIT")
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
