"""http.request_timeout is the longest database call of one request: with the database gone silent
(a network partition: packets dropped, nothing closed) a request answers 503 at its deadline, not
after the driver's cancel request and its wait (5 s + 5 s) inside the cancelled call."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from support.http_server import TOKEN, RunningServer, http_config
from support.tcp_proxy import TcpProxy

from harvester.services.http import cutoff

REQUEST_TIMEOUT = 1.0
# psycopg waits up to 5 s for its cancel request and 5 s more for the query to stop: an answer
# before this came at the deadline, not after that wait.
CANCEL_WAIT = 5.0


class SilentProxy(TcpProxy):
    """Forwards TCP both ways until silenced: from then on it drops what either side sends and
    closes nothing, as a network partition does."""

    silent = False

    def silence(self) -> None:
        self.silent = True

    def _pump(self, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
        try:
            while data := src.recv(65536):
                if not self.silent:
                    dst.sendall(data)
        except OSError:
            pass


def test_work_past_its_deadline_is_left_to_end_in_the_background():
    async def scenario() -> None:
        ended = asyncio.Event()

        async def stubborn() -> None:  # as psycopg: a cancelled call first waits for its cancel
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(0.2)
                ended.set()
                raise RuntimeError("what the cleanup met") from None  # retrieved, never logged as lost

        with pytest.raises(TimeoutError):
            await cutoff.by_deadline(stubborn(), 0.05)
        assert not ended.is_set() and cutoff.cleaning() == 1  # answered before the work ended
        await asyncio.wait_for(ended.wait(), 30)
        await asyncio.sleep(0)
        assert cutoff.cleaning() == 0

    asyncio.run(scenario())


def test_work_within_its_deadline_answers_its_result_or_its_error():
    async def scenario() -> None:
        async def fine() -> int:
            return 7

        async def broken() -> int:
            raise ValueError("bad")

        assert await cutoff.by_deadline(fine(), 5) == 7
        with pytest.raises(ValueError):
            await cutoff.by_deadline(broken(), 5)

    asyncio.run(scenario())


@pytest.mark.parametrize("backend", ["tracker", "sql"])
def test_a_silent_database_answers_503_at_the_request_timeout(pg_dsn, schema, backend):
    d = conninfo_to_dict(pg_dsn)
    proxy = SilentProxy(f"{d.get('host', '127.0.0.1')}:{d.get('port', 5432)}")
    d.update(host="127.0.0.1", port=str(proxy.port))
    cfg = http_config(make_conninfo(**d), schema, request_timeout=REQUEST_TIMEOUT, backend=backend)
    try:
        with (
            RunningServer(cfg, [TOKEN]) as s,
            httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as c,
        ):
            b = c.post("/v1/batches", json={}).json()["batch_id"]
            assert c.get(f"/v1/batches/{b}").status_code == 200
            proxy.silence()
            calls = {
                "status": lambda: c.get(f"/v1/batches/{b}"),
                "add": lambda: c.post(f"/v1/batches/{b}/items", json={"count": 1}),
                "idempotent add": lambda: c.post(
                    f"/v1/batches/{b}/items", json={"count": 1}, headers={"Idempotency-Key": '"k-1"'}
                ),
            }
            for name, call in calls.items():
                started = time.monotonic()
                r = call()
                took = time.monotonic() - started
                assert r.status_code == 503 and r.json()["type"].endswith(":unavailable"), (name, r.text)
                assert took < REQUEST_TIMEOUT + CANCEL_WAIT - 1, (name, round(took, 1))
    finally:
        proxy.close()
