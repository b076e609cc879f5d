"""`reaper serve` as a real process: refusing to start without tokens, TLS, JSON access logs, and a
graceful shutdown on SIGTERM that answers an in-flight long-poll."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from support.reaper import run_cli

REPO = Path(__file__).resolve().parents[1]
TOKEN = "serve-token-0123456789abcdef"


def _env(pg_dsn: str, schema: str, **http: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(
        {
            "REAPER_DATABASE__DSN": pg_dsn,
            "REAPER_DATABASE__SCHEMA": schema,
            "REAPER_LOGGING__FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update({f"REAPER_HTTP__{k.upper()}": v for k, v in http.items()})
    return env


def _serve(env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
    )


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, verify: object = True) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"reaper serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/readyz", verify=verify, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"reaper serve did not become ready:\n{log.read_text()}")


@pytest.mark.parametrize(
    "http, message",
    [
        ({}, "no bearer tokens configured"),
        ({"local_mode": "true", "host": "0.0.0.0"}, "only on a loopback address"),
        ({"tokens": "short"}, "at least 16 characters"),
        ({"tokens_file": "/nonexistent/tokens"}, "cannot read /nonexistent/tokens"),
        ({"tokens": TOKEN, "tls_certfile": "/x.pem"}, "set both http.tls_certfile and http.tls_keyfile"),
    ],
)
def test_refuses_to_start_without_valid_tokens(pg_dsn, schema, http, message):
    r = run_cli(["serve"], _env(pg_dsn, schema, **http))
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_local_mode_serves_without_tokens_on_loopback(pg_dsn, schema, tmp_path):
    port = free_port()
    proc = _serve(_env(pg_dsn, schema, local_mode="true", port=str(port)), tmp_path / "log")
    try:
        _wait_ready(f"http://127.0.0.1:{port}", proc, tmp_path / "log")
        assert httpx.post(f"http://127.0.0.1:{port}/v1/batches", json={}).status_code == 201
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_sigterm_answers_the_long_poll_and_exits_cleanly_with_access_logs(pg_dsn, schema, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# the only client\n{TOKEN}\n")
    port, log = free_port(), tmp_path / "log"
    proc = _serve(_env(pg_dsn, schema, tokens_file=str(tokens), port=str(port), shutdown_timeout="20"), log)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log)
        h = {"Authorization": f"Bearer {TOKEN}"}
        b = httpx.post(f"{url}/v1/batches", json={"user_key": "k"}, headers=h).json()["batch_id"]
        got: dict = {}

        def poll() -> None:
            got["r"] = httpx.get(f"{url}/v1/batches/{b}/completion", params={"wait": 55}, headers=h, timeout=60)

        t = threading.Thread(target=poll)
        t.start()
        # wait until the long-poll is inside the server (in flight: it and this scrape itself)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics").text
            gauge = [line for line in text.splitlines() if line.startswith("reaper_http_requests_in_flight ")]
            if gauge and float(gauge[0].split()[1]) >= 2:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the long-poll never reached the server")
        proc.send_signal(signal.SIGTERM)
        t.join(timeout=30)
        assert not t.is_alive(), "the long-poll was not answered at shutdown"
        assert got["r"].status_code == 200 and got["r"].json()["state"] == "open"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    access = [e for e in events if e.get("event") == "http request"]
    assert {(e["method"], e["route"], e["status"]) for e in access} >= {
        ("POST", "/v1/batches", 201),
        ("GET", "/v1/batches/{batch_id}/completion", 200),
    }
    assert all(e["token"] in (None, "local") or e["token"].startswith("tok-") for e in access)
    assert TOKEN not in log.read_text()
    assert any(e.get("event") == "http service stopped" for e in events)


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls(pg_dsn, schema, tmp_path):
    cert, key = _self_signed(tmp_path)
    port, log = free_port(), tmp_path / "log"
    trust = ssl.create_default_context(cafile=str(cert))
    proc = _serve(_env(pg_dsn, schema, tokens=TOKEN, port=str(port), tls_certfile=str(cert), tls_keyfile=str(key)), log)
    try:
        _wait_ready(f"https://127.0.0.1:{port}", proc, log, verify=trust)
        r = httpx.post(
            f"https://127.0.0.1:{port}/v1/batches", json={}, headers={"Authorization": f"Bearer {TOKEN}"}, verify=trust
        )
        assert r.status_code == 201
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_tls_handshake_left_unfinished_is_closed_at_the_header_timeout(pg_dsn, schema, tmp_path):
    cert, key = _self_signed(tmp_path)
    port, log = free_port(), tmp_path / "log"
    env = _env(
        pg_dsn, schema, tokens=TOKEN, port=str(port), tls_certfile=str(cert), tls_keyfile=str(key), header_timeout="1"
    )
    proc = _serve(env, log)
    try:
        _wait_ready(f"https://127.0.0.1:{port}", proc, log, verify=ssl.create_default_context(cafile=str(cert)))
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then nothing
            try:
                while s.recv(65536):
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
        held = time.monotonic() - started
        # closed at the header timeout (1 s), not asyncio's own handshake bound (60 s)
        assert held < 10, f"a connection that never finished its TLS handshake was held {held:.1f} s"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_fractional_shutdown_timeout_is_kept_as_it_is(pg_dsn, schema):
    from support.http_server import http_config

    from harvester.services.http.server import build

    server, _ = build(http_config(pg_dsn, schema, tokens=TOKEN, shutdown_timeout=0.5))
    assert server.config.timeout_graceful_shutdown == 0.5  # not 0: in-flight requests get their half second


def test_sighup_rereads_the_tenants_file_and_the_server_serves_on(pg_dsn, schema, tmp_path):
    from harvester.services.http.tenants import new_token

    first, first_digest = new_token()
    later, later_digest = new_token()
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f'tenants:\n  billing:\n    tokens: ["{first_digest}"]\n')
    port, log = free_port(), tmp_path / "log"
    proc = _serve(_env(pg_dsn, schema, tenants_file=str(tenants), port=str(port)), log)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, log)
        # The same size and a second's mtime apart at most: only SIGHUP makes the server look again
        tenants.write_text(f'tenants:\n  billing:\n    tokens: ["{later_digest}"]\n')
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while log.read_text().count('"tenants loaded"') < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert log.read_text().count('"tenants loaded"') >= 2, log.read_text()[-3000:]
        answer = httpx.get(url + "/v1/batches/1", headers={"Authorization": f"Bearer {later}"}, timeout=10)
        assert answer.status_code == 404, answer.text  # the new token is known: no such batch
        assert proc.poll() is None, "SIGHUP stopped the server"
        assert all(line.startswith("{") for line in log.read_text().splitlines() if line.strip())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
