"""`reaper run` from start to stop as operators meet it: a start-up failure is reported as itself
(and whatever started is stopped), SIGHUP never stops the process, a second SIGTERM stops it at
once, and a component whose thread ends while the process runs stops it with exit code 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import KafkaException, Producer
from support.harness import env_for, insert_rows, make_config, outbox_marks, wait_until
from support.ports import free_port
from support.reaper import ReaperProcess

from harvester.exit_codes import ExitCode
from harvester.publishing.ports import Providers
from harvester.services.http.tenants import new_token
from harvester.units import Harvester

REPO = Path(__file__).resolve().parents[1]


def _env(pg_dsn: str, schema: str, kafka_bootstrap: str, **extra: str) -> dict[str, str]:
    return {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_DATABASE__STARTUP_TIMEOUT": "5",
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__ENABLED": "false",
        **extra,
    }


def _console_env(pg_dsn: str, schema: str, kafka_bootstrap: str, **extra: str) -> dict[str, str]:
    """_env with the operator's console on a free loopback port."""
    return _env(
        pg_dsn,
        schema,
        kafka_bootstrap,
        REAPER_CONSOLE__RUN="true",
        REAPER_CONSOLE__HOST="127.0.0.1",
        REAPER_CONSOLE__PORT=str(free_port()),
        **extra,
    )


def _named(reaper: ReaperProcess, event: str) -> list[dict]:
    return [e for e in reaper.events() if e.get("event") == event]


class ScriptedReaper(ReaperProcess):
    """`reaper run` as ReaperProcess runs it (the same defaults), started by `code`: a python -c
    script run from the repository that changes one part of it first."""

    def __init__(self, code: str, env: dict[str, str], log_path: Path) -> None:
        super().__init__(env, log_path, command=[sys.executable, "-c", code])


# ------------------------------------------------------------------ a failed start is reported as itself


def test_a_console_without_tokens_exits_2_naming_the_key_and_stops_what_started(
    pg_dsn, schema, kafka_bootstrap, tmp_path
):
    """The console refuses to start without tokens after the metrics server started and the gauges
    thread was set up but not started: the operator sees the refusal (exit 2, http.tokens), and
    the metrics server is stopped, not "cannot join thread before it is started"."""
    env = _console_env(
        pg_dsn,
        schema,
        kafka_bootstrap,
        REAPER_METRICS__ENABLED="true",
        REAPER_METRICS__HOST="127.0.0.1",
        REAPER_METRICS__PORT="0",
    )
    reaper = ReaperProcess(env, tmp_path / "r.log")
    try:
        code = reaper.wait(60)
    finally:
        reaper.kill()
    text = reaper.log_path.read_text()
    assert code == ExitCode.USAGE, text[-3000:]
    assert "cannot join thread" not in text
    (cannot,) = _named(reaper, "cannot start")
    assert "http.tokens" in cannot["error"], cannot
    assert _named(reaper, "stopped"), "the clean-up did not run to its end"


def _refused_producer(conf: dict) -> Producer:
    return Producer({**conf, "acks": "banana"})  # librdkafka refuses the value


def test_a_harvester_whose_second_unit_fails_to_start_raises_that_failure_and_closes_the_first(
    pg_dsn, schema, kafka_bootstrap, topics
):
    """Unit 0 starts (its threads run), unit 1's producer is refused: start() raises librdkafka's
    refusal, not the clean-up's "cannot join thread before it is started", and unit 0 is stopped."""
    made: list[dict] = []

    def second_refused(conf: dict) -> Producer:
        made.append(conf)
        return Producer(conf) if len(made) == 1 else _refused_producer(conf)

    cfg = make_config(
        pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader", partitions=2), harvester={"lanes": 2}
    )
    h = Harvester(cfg, providers=Providers(producer=second_refused, description="unit 1's producer is refused"))
    with pytest.raises(KafkaException, match="request.required.acks"):
        h.start()
    first, second = h.units
    assert first._thread.ident is not None and not first._thread.is_alive()
    assert not first._producer_thread.is_alive()
    assert first.pool is not None and first.pool.closed
    assert second._thread.ident is None and second.pool is not None and second.pool.closed


REFUSED_PRODUCER_RUN = """
import sys
from confluent_kafka import Producer
from harvester import config as config_mod, run as run_mod
from harvester.publishing.ports import Providers

cfg = config_mod.load(None)
run_mod.configure_logging(cfg)
refused = Providers(producer=lambda conf: Producer({**conf, "acks": "banana"}), description="refused producer")
sys.exit(run_mod.run(cfg, providers=refused))
"""


def test_reaper_run_logs_why_the_harvester_could_not_start(pg_dsn, schema, kafka_bootstrap, topics, tmp_path):
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"))
    env = {**_env(pg_dsn, schema, kafka_bootstrap), **env_for(cfg), "REAPER_HARVESTER__ENABLED": "true"}
    reaper = ScriptedReaper(REFUSED_PRODUCER_RUN, env, tmp_path / "r.log")
    try:
        code = reaper.wait(60)
    finally:
        reaper.kill()
    text = reaper.log_path.read_text()
    assert code == ExitCode.FAILURE, text[-3000:]
    assert "cannot join thread" not in text
    failed = _named(reaper, "component failed")
    assert [e["component"] for e in failed] == ["startup"], failed
    assert "request.required.acks" in failed[0]["error"], failed
    assert all(line.startswith("{") for line in text.splitlines()), "a line that is not JSON"


# ------------------------------------------------------------------ SIGHUP


def test_sighup_rereads_the_consoles_tenants_file_and_the_reaper_runs_on(pg_dsn, schema, kafka_bootstrap, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    _, digest = new_token()
    tenants.write_text(f'tenants:\n  billing:\n    tokens: ["{digest}"]\n')
    env = _console_env(
        pg_dsn,
        schema,
        kafka_bootstrap,
        REAPER_HTTP__TENANTS_FILE=str(tenants),
    )
    reaper = ReaperProcess(env, tmp_path / "r.log")
    try:
        assert wait_until(lambda: _named(reaper, "console listening"), 60), reaper.log_path.read_text()[-3000:]
        assert len(_named(reaper, "tenants loaded")) == 1
        _, second = new_token()
        tenants.write_text(f'tenants:\n  billing:\n    tokens: ["{digest}", "{second}"]\n')
        reaper.signal(signal.SIGHUP)
        assert wait_until(lambda: len(_named(reaper, "tenants loaded")) == 2, 10), reaper.log_path.read_text()[-3000:]
        assert _named(reaper, "tenants loaded")[-1]["tokens"] == 2
        assert _named(reaper, "SIGHUP received: re-reading the tenants file")
        time.sleep(0.5)
        assert reaper.proc.poll() is None, "SIGHUP stopped the reaper"
        assert reaper.terminate(30) == ExitCode.OK
    finally:
        reaper.kill()


def test_sighup_without_a_console_is_logged_and_the_reaper_runs_on(pg_dsn, schema, kafka_bootstrap, tmp_path):
    reaper = ReaperProcess(_env(pg_dsn, schema, kafka_bootstrap), tmp_path / "r.log")
    try:
        assert wait_until(lambda: _named(reaper, "starting"), 30)
        time.sleep(1)  # past the start-up checks
        reaper.signal(signal.SIGHUP)
        hup = "SIGHUP received: nothing to re-read (the tenants file is re-read only with console.run and "
        hup += "http.tenants_file set)"
        assert wait_until(lambda: _named(reaper, hup), 10), reaper.log_path.read_text()[-3000:]
        assert reaper.proc.poll() is None, "SIGHUP stopped the reaper"
        assert reaper.terminate(30) == ExitCode.OK
    finally:
        reaper.kill()


# ------------------------------------------------------------------ a second SIGTERM


@pytest.mark.xdist_group("reaper-failover")
def test_a_second_sigterm_stops_at_once_and_exits_4_with_records_still_in_flight(
    pg_dsn, schema, kafka_bootstrap, tmp_path
):
    """Records to a topic that does not exist stay in flight (librdkafka waits for the topic):
    the first SIGTERM's drain would wait out harvester.drain_timeout (30 s); the second ends it."""
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"drain_timeout": 30.0})
    reaper = ReaperProcess(env_for(cfg), tmp_path / "r.log")
    try:
        assert reaper.wait_leader(60), reaper.log_path.read_text()[-3000:]
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, f"missing-{uuid.uuid4().hex[:12]}", [(b"k", b"v%d" % i) for i in range(50)])
        assert wait_until(lambda: all(m is not None for m in outbox_marks(pg_dsn, schema).values()), 30)
        time.sleep(1)  # handed to the producer
        reaper.signal(signal.SIGTERM)
        time.sleep(2)
        assert reaper.proc.poll() is None, "the drain did not wait for the records in flight"
        again = time.monotonic()
        reaper.signal(signal.SIGTERM)
        code = reaper.wait(15)
        took = time.monotonic() - again
    finally:
        reaper.kill()
    assert code == ExitCode.DRAIN_TIMEOUT, reaper.log_path.read_text()[-3000:]
    assert took < 8, took
    assert _named(reaper, "signal received again: stopping at once, without waiting for the drain")
    (cut,) = _named(
        reaper, "stopping without waiting for the drain: records still in flight are left for the next leader"
    )
    assert cut["in_flight"] > 0 and cut["unit"] == "default"
    assert _named(reaper, "stopped")[0]["drained"] is False


# ------------------------------------------------------------------ a component thread that ends


DYING_INBOX_RUN = """
import sys
from harvester import cli, run as run_mod

def inbox_loop(cfg, pool, stop):
    if not stop.wait(1.0):
        raise RuntimeError("inbox maintenance broke")

run_mod.inbox_loop = inbox_loop
sys.exit(cli.main(["run"]))
"""


def test_a_component_thread_that_dies_stops_the_reaper_with_exit_1(pg_dsn, schema, kafka_bootstrap, tmp_path):
    reaper = ScriptedReaper(DYING_INBOX_RUN, _env(pg_dsn, schema, kafka_bootstrap), tmp_path / "r.log")
    try:
        code = reaper.wait(30)  # no signal: it stops by itself
    finally:
        reaper.kill()
    text = reaper.log_path.read_text()
    assert code == ExitCode.FAILURE, text[-3000:]
    (crashed,) = _named(reaper, "component stopped by an error")
    assert crashed["component"] == "inbox" and "inbox maintenance broke" in crashed["exception"], crashed
    failed = _named(reaper, "component failed")
    assert [(e["component"], e["error"]) for e in failed] == [("inbox", "RuntimeError: inbox maintenance broke")]
    assert all(line.startswith("{") for line in text.splitlines()), "a line that is not JSON"
