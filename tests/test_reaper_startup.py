"""`reaper run` at start: while no database primary accepts connections or Kafka does not answer,
it tries again for database.startup_timeout seconds (one log line per distinct reason) and starts
as soon as both answer; then, or at once with 0, it exits 3 (UNAVAILABLE). A schema that is not
migrated is not waited for, and a signal ends the wait at once."""

from __future__ import annotations

import signal
import time

from support.harness import wait_until
from support.ports import free_port
from support.reaper import ReaperProcess
from support.tcp_proxy import KafkaProxy, TcpProxy
from test_harvester_cli import _safe_get

WAITING = "waiting for the database and Kafka"


def _env(dsn: str, schema: str, bootstrap: str, timeout: float, port: int | None = None) -> dict[str, str]:
    env = {
        "REAPER_DATABASE__DSN": dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_DATABASE__STARTUP_TIMEOUT": str(timeout),
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "REAPER_HARVESTER__ENABLED": "false",
    }
    if port is not None:
        env |= {
            "REAPER_METRICS__ENABLED": "true",
            "REAPER_METRICS__HOST": "127.0.0.1",
            "REAPER_METRICS__PORT": str(port),
        }
    return env


def _named(reaper: ReaperProcess, event: str) -> list[dict]:
    return [e for e in reaper.events() if e.get("event") == event]


def _forwarded_dsn(pg_dsn: str, proxy: TcpProxy) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    parts = conninfo_to_dict(pg_dsn)
    parts.update(host=proxy.host, port=str(proxy.port))
    return make_conninfo(**parts)


def test_with_startup_timeout_0_an_unreachable_database_exits_3_at_once(pg_dsn, schema, kafka_bootstrap, tmp_path):
    with TcpProxy("127.0.0.1:1", listening=False) as nothing:  # never up: connections refused
        started = time.monotonic()
        reaper = ReaperProcess(_env(_forwarded_dsn(pg_dsn, nothing), schema, kafka_bootstrap, 0), tmp_path / "r.log")
        try:
            assert reaper.wait(30) == 3
        finally:
            reaper.kill()
    assert time.monotonic() - started < 15
    assert not _named(reaper, WAITING)
    (cannot,) = _named(reaper, "cannot start")
    assert "database unreachable" in cannot["error"], cannot


def test_an_unreachable_database_is_waited_for_until_the_timeout(pg_dsn, schema, kafka_bootstrap, tmp_path):
    with TcpProxy("127.0.0.1:1", listening=False) as nothing:
        started = time.monotonic()
        reaper = ReaperProcess(_env(_forwarded_dsn(pg_dsn, nothing), schema, kafka_bootstrap, 3), tmp_path / "r.log")
        try:
            assert reaper.wait(60) == 3
        finally:
            reaper.kill()
    assert 3 <= time.monotonic() - started < 30
    (waiting,) = _named(reaper, WAITING)  # several tries, one reason: one line
    assert "database unreachable" in waiting["error"] and waiting["timeout"] == 3
    (cannot,) = _named(reaper, "cannot start")
    assert "database unreachable" in cannot["error"] and cannot["waited"] >= 3, cannot


def test_a_reaper_started_before_its_database_waits_and_becomes_ready(pg_dsn, schema, kafka_bootstrap, tmp_path):
    port = free_port()
    with TcpProxy(_upstream(pg_dsn), listening=False) as later:
        reaper = ReaperProcess(
            _env(_forwarded_dsn(pg_dsn, later), schema, kafka_bootstrap, 60, port) | {"REAPER_ACKER__ENABLED": "true"},
            tmp_path / "r.log",
        )
        try:
            assert wait_until(lambda: _named(reaper, WAITING), 30), reaper.log_path.read_text()[-2000:]
            time.sleep(3)  # a few more tries (0.5 s, 1 s, 2 s apart)
            assert reaper.proc.poll() is None
            assert _safe_get(f"http://127.0.0.1:{port}/readyz")[0] == 0  # nothing serves yet
            later.up()
            assert wait_until(lambda: _safe_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 30)
            assert wait_until(lambda: _named(reaper, "acker started"), 30)
            assert reaper.terminate(60) == 0
        finally:
            reaper.kill()
    assert len(_named(reaper, WAITING)) == 1
    (available,) = _named(reaper, "database and Kafka available")
    assert available["waited"] >= 3


def test_a_reaper_started_before_kafka_waits_for_it(pg_dsn, schema, kafka_bootstrap, tmp_path):
    port = free_port()
    broker = KafkaProxy(kafka_bootstrap, listening=False)  # the broker's address refuses connections until up()
    reaper = ReaperProcess(_env(pg_dsn, schema, broker.address, 60, port), tmp_path / "r.log")
    try:
        assert wait_until(lambda: _named(reaper, WAITING), 60), reaper.log_path.read_text()[-2000:]
        assert "Kafka unreachable" in _named(reaper, WAITING)[0]["error"]
        broker.up()
        assert wait_until(lambda: _safe_get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60)
        assert reaper.terminate(60) == 0
    finally:
        reaper.kill()
        broker.close()
    assert _named(reaper, "database and Kafka available")


def test_sigterm_while_waiting_exits_3_promptly(pg_dsn, schema, kafka_bootstrap, tmp_path):
    with TcpProxy("127.0.0.1:1", listening=False) as nothing:
        reaper = ReaperProcess(_env(_forwarded_dsn(pg_dsn, nothing), schema, kafka_bootstrap, 60), tmp_path / "r.log")
        try:
            assert wait_until(lambda: _named(reaper, WAITING), 30), reaper.log_path.read_text()[-2000:]
            time.sleep(1)
            signalled = time.monotonic()
            reaper.signal(signal.SIGTERM)
            assert reaper.wait(30) == 3
            # promptly: well before the 60 s it was told to wait, with room for a loaded machine
            assert time.monotonic() - signalled < 15
        finally:
            reaper.kill()
    assert _named(reaper, "cannot start: stopped by a signal while waiting")


def test_a_schema_not_migrated_is_not_waited_for(pg_dsn, kafka_bootstrap, tmp_path):
    started = time.monotonic()
    reaper = ReaperProcess(_env(pg_dsn, "t_never_migrated", kafka_bootstrap, 60), tmp_path / "r.log")
    try:
        assert reaper.wait(30) == 3
    finally:
        reaper.kill()
    assert time.monotonic() - started < 20
    assert not _named(reaper, WAITING)
    (cannot,) = _named(reaper, "cannot start")
    assert "does not exist: run `reaper migrate`" in cannot["error"], cannot


def _upstream(pg_dsn: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(pg_dsn)
    return f"{parts.get('host', '127.0.0.1')}:{parts.get('port', '5432')}"
