"""A metrics.port already taken is named, as console.port is: the metrics server's failure says
the key, the port and the address, and `reaper run` logs it as the metrics server's."""

from __future__ import annotations

import json
import os
import socket

import pytest
from support.reaper import run_cli

from harvester.exit_codes import ExitCode
from harvester.health_server import CannotListen, HealthServer


def _taken() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_the_metrics_server_names_a_taken_port():
    with _taken() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(CannotListen) as err:
            HealthServer("127.0.0.1", port, lambda: (True, "ready"))
    assert f"metrics.port {port} is in use on 127.0.0.1" in str(err.value), err.value


def test_reaper_run_logs_the_metrics_server_and_its_port(pg_dsn, schema, kafka_bootstrap):
    with _taken() as taken:
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
        env.update(
            REAPER_DATABASE__DSN=pg_dsn,
            REAPER_DATABASE__SCHEMA=schema,
            REAPER_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
            REAPER_HARVESTER__ENABLED="false",
            REAPER_ACKER__ENABLED="false",
            REAPER_METRICS__HOST="127.0.0.1",
            REAPER_METRICS__PORT=str(port),
            REAPER_LOGGING__FORMAT="json",
        )
        r = run_cli(["run"], env)
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] == "component failed"]
    assert r.returncode == ExitCode.FAILURE and failed, r.stderr[-1500:]
    assert failed[0]["component"] == "metrics server", failed
    assert f"metrics.port {port} is in use" in failed[0]["error"], failed
