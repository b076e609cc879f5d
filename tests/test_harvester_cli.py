"""`reaper run` as operators meet it: configuration errors, secrets, exit codes, endpoints, signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest
from support.harness import Receiver, insert_rows, wait_until
from support.ports import free_port
from support.reaper import run_cli
from support.teardown import drop_schema

from harvester import config as config_mod
from harvester.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(extra)
    return env


def test_bad_configuration_fails_at_start_naming_the_key(tmp_path):
    r = run_cli(["run"], _env(REAPER_HARVESTER__HEARTBEAT_TIMEOUT="soon"))
    assert r.returncode == 2 and "harvester.heartbeat_timeout" in r.stderr, r.stderr
    cfg = tmp_path / "reaper.yaml"
    cfg.write_text("harvester:\n  mark_bach: 10\n")
    r = run_cli(["-c", str(cfg), "run"], _env())
    assert r.returncode == 2 and "harvester.mark_bach" in r.stderr, r.stderr
    r = run_cli(["run"], _env(REAPER_DATABASE__SCHEMA="x; drop table outbox"))
    assert r.returncode == 2 and "database.schema" in r.stderr, r.stderr
    r = run_cli(["run"], _env(REAPER_KAFKA__PRODUCER__ENABLE_IDEMPOTENCE="false"))
    assert r.returncode == 2 and "kafka.producer.enable.idempotence" in r.stderr, r.stderr


def test_transactional_id_is_validated_and_only_set_through_its_harvester_key():
    with pytest.raises(config_mod.ConfigError, match="harvester.transactional_id.*'has space'"):
        config_mod.load(None, environ={"REAPER_HARVESTER__TRANSACTIONAL_ID": "has space"})
    with pytest.raises(config_mod.ConfigError, match="kafka.producer.transactional.id.*harvester.transactional_id"):
        config_mod.load(None, environ={"REAPER_KAFKA__PRODUCER__TRANSACTIONAL_ID": "x"})
    assert (
        config_mod.load(
            None, environ={"REAPER_HARVESTER__TRANSACTIONAL_ID": "orders-outbox"}
        ).harvester.transactional_id
        == "orders-outbox"
    )
    assert config_mod.load(None, environ={}).harvester.transactional_id == ""


def test_configuration_layers_and_kafka_passthrough(tmp_path):
    path = tmp_path / "reaper.yaml"
    path.write_text(
        "database:\n  schema: app\nkafka:\n  client:\n    security.protocol: SASL_SSL\nharvester:\n  mark_batch: 1000\n"
    )
    cfg = config_mod.load(
        path,
        environ={
            "REAPER_HARVESTER__MARK_BATCH": "2000",
            "REAPER_KAFKA__CLIENT__SASL_USERNAME": "svc",
            "REAPER_KAFKA__PRODUCER__LINGER_MS": "1",
        },
    )
    assert cfg.database.schema == "app" and cfg.harvester.mark_batch == 2000
    assert cfg.kafka.client == {"security.protocol": "SASL_SSL", "sasl.username": "svc"}
    assert cfg.kafka.producer == {"linger.ms": "1"}
    assert config_mod.redact("kafka.client", {"sasl.password": "pw", "sasl.username": "svc"}) == {
        "sasl.password": "***",
        "sasl.username": "svc",
    }


def test_the_product_has_no_fault_injection():
    """Fault injection lives in tests/support: no harvester module imports it and `reaper run`
    knows no flag for it."""
    r = run_cli(["run", "--enable-fault-injection"], _env())
    assert r.returncode == 2 and "unrecognized arguments" in r.stderr, r.stderr
    code = "import sys, harvester.cli, harvester.run, harvester.publishing.mark_purge_reset; print(sorted(m for m in sys.modules if 'faults' in m.split('.') or 'faulty_reaper' in m))"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    assert not (REPO / "harvester" / "faults.py").exists()


def test_unreachable_database_exits_3_and_secrets_stay_out_of_the_output():
    r = run_cli(
        ["run"],
        _env(
            REAPER_DATABASE__DSN="postgresql://app:s3cret-pw@127.0.0.1:1/outbox",
            REAPER_DATABASE__STARTUP_TIMEOUT="0",  # no wait (test_reaper_startup.py waits)
            REAPER_KAFKA__CLIENT__SASL_PASSWORD="kafka-s3cret",
            REAPER_LOGGING__FORMAT="json",
        ),
    )
    assert r.returncode == 3, (r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert "s3cret-pw" not in out and "kafka-s3cret" not in out
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert any(e["event"] == "cannot start" and "database unreachable" in e["error"] for e in events), out
    assert any(e["event"] == "starting" for e in events) and all("leader_id" in e for e in events)


def test_migrate_with_the_database_unreachable_exits_3_like_every_command():
    env = _env(REAPER_DATABASE__DSN="postgresql://app:s3cret-pw@127.0.0.1:1/outbox")
    for args in (["migrate"], ["migrate", "--dry-run"], ["outbox", "status"]):
        r = run_cli(args, env)
        assert r.returncode == 3, (args, r.stdout, r.stderr)
        assert "s3cret-pw" not in r.stdout + r.stderr
    assert "reaper migrate: database unreachable" in run_cli(["migrate"], env).stderr


def test_console_log_format_is_readable_text():
    r = run_cli(
        ["run"],
        _env(
            REAPER_DATABASE__DSN="postgresql://app@127.0.0.1:1/outbox",
            REAPER_DATABASE__STARTUP_TIMEOUT="0",
            REAPER_LOGGING__FORMAT="console",
        ),
    )
    assert r.returncode == 3
    assert "cannot start" in r.stderr and not any(line.startswith("{") for line in r.stderr.splitlines())


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.xdist_group("reaper-failover")
def test_run_serves_endpoints_publishes_and_exits_0_on_sigterm(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    topic = topics("data", partitions=2)
    acks, dead = topics("acks"), topics("acks-dlq")
    port = free_port()
    leader_topic = f"leader-{uuid.uuid4().hex[:10]}"  # reaper creates it
    env = _env(
        REAPER_DATABASE__DSN=pg_dsn,
        REAPER_DATABASE__SCHEMA=schema,
        REAPER_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        REAPER_HARVESTER__LEADER_TOPIC=leader_topic,
        REAPER_HARVESTER__LEADER_GROUP=f"g-{uuid.uuid4().hex[:8]}",
        REAPER_ACKER__TOPIC=acks,
        REAPER_ACKER__DEAD_LETTER_TOPIC=dead,
        REAPER_ACKER__GROUP=f"a-{uuid.uuid4().hex[:8]}",
        REAPER_SWEEPER__INTERVAL="3600",  # no sweep while it runs: its counters must be there all the same
        REAPER_METRICS__PORT=str(port),
        REAPER_METRICS__HOST="127.0.0.1",
        REAPER_METRICS__BACKLOG_INTERVAL="0.5",
        REAPER_LOGGING__FORMAT="json",
    )
    log = open(tmp_path / "reaper.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "run"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    receiver = Receiver(kafka_bootstrap, topic, 2)
    try:
        base = f"http://127.0.0.1:{port}"
        assert wait_until(lambda: _safe_get(base + "/healthz")[0] == 200, 60)
        assert wait_until(lambda: _safe_get(base + "/readyz")[0] == 200, 30)
        assert wait_until(lambda: "reaper_leader 1.0" in _safe_get(base + "/metrics")[1], 60)
        with psycopg.connect(pg_dsn) as conn:
            insert_rows(conn, schema, topic, [(b"k", b"k:%d" % i) for i in range(100)])
        assert receiver.wait_for({(b"k", b"k:%d" % i) for i in range(100)}, 30)
        metrics = _get(base + "/metrics")[1]
        for name in (
            "reaper_build_info",
            "reaper_records_published_total",
            "reaper_outbox_backlog_rows",
            "reaper_outbox_oldest_age_seconds",
            "reaper_records_in_flight",
            "reaper_batches",
            "reaper_items_pending",
            "reaper_mark_duration_seconds_bucket",
            "reaper_leader_acquisitions_total",
        ):
            assert name in metrics, name
        # at 0 from the start, not from the first sweep (an alert on their increase must see that one)
        for counter in ("reaper_batches_expired_total", "reaper_batches_completed_total"):
            assert f'{counter}{{schema="{schema}"}} 0.0' in metrics, counter
        assert _get(base + "/nope")[0] == 404
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        receiver.close()
        log.close()
    events = [json.loads(line) for line in (tmp_path / "reaper.log").read_text().splitlines() if line.startswith("{")]
    names = [e["event"] for e in events]
    assert "neli leader" in names and "acker started" in names and "stopped" in names, names
    assert all("leader_id" in e for e in events if e.get("logger") is None)


def _safe_get(url: str) -> tuple[int, str]:
    try:
        return _get(url)
    except OSError:
        return 0, ""


def test_version_names_the_installed_distribution_and_needs_no_configuration():
    from importlib.metadata import version

    done = run_cli(["--version"], _env(REAPER_DATABASE__DSN="postgresql://nobody@127.0.0.1:1/none"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"reaper (outbox-reaper) {version('outbox-reaper')}"


def test_migrate_dry_run_prints_the_transactions_migrate_runs(pg_dsn, schema):
    """Each migration in a transaction of its own, then every changed definition in one: the
    transactions a DBA who runs the printed script gets are those `reaper migrate` runs."""
    from tracker import schema as schema_mod

    fresh = f"{schema}_dry"
    env = _env(REAPER_DATABASE__DSN=pg_dsn, REAPER_DATABASE__SCHEMA=fresh)
    r = run_cli(["migrate", "--dry-run"], env)
    assert r.returncode == 0, r.stderr
    script = r.stdout
    assert script.count("BEGIN;") == len(schema_mod.migrations()) + 1 == script.count("COMMIT;")
    assert script.count("-- the changed definitions, in one transaction") == 1
    try:
        done = subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", pg_dsn, "-f", "-"],
            input=f"CREATE SCHEMA {fresh};\n" + script,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        drop_schema(pg_dsn, fresh)


@pytest.mark.parametrize(
    "args",
    [["migrate"], ["outbox", "status"], ["dead", "list"], ["dead", "list", "--json"]],
    ids=lambda a: " ".join(a),
)
def test_ctrl_c_while_a_command_waits_ends_it_with_one_line_and_exit_130(silent_server, args):
    """SIGINT as a terminal's Ctrl-C sends it, while the command waits for a database that never
    answers: one line in the command's own form, exit code 130 (INTERRUPTED), no traceback."""
    env = _env(REAPER_DATABASE__DSN=f"postgresql://app@{silent_server}/outbox")
    proc = subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a shell starts it
    )
    try:
        time.sleep(3)  # started, and waiting for the database
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130 == ExitCode.INTERRUPTED, (proc.returncode, out, err)
    name = "reaper " + " ".join(a for a in args if a != "--json")
    assert err.splitlines() == [
        f"{name}: interrupted (SIGINT) before it finished; what it had not committed was rolled back"
    ]
    if "--json" in args:
        assert json.loads(out)["exit_code"] == 130, out
    else:
        assert out == ""


@pytest.mark.parametrize("command", [["migrate", "--dry-run"], ["migrate", "--roles", "print"], ["dead", "list"]])
def test_output_whose_reader_went_away_ends_quietly_with_its_own_exit_code(pg_dsn, schema, command):
    """`reaper ... | head`: the reader closes the pipe first. No traceback or BrokenPipeError line,
    and not exit 1 (which says the database or Kafka failed)."""
    from support.reaper import REPO

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written: every write meets EPIPE
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env |= {"REAPER_DATABASE__DSN": pg_dsn, "REAPER_DATABASE__SCHEMA": schema}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "harvester.cli", *command],
            cwd=REPO,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == ExitCode.PIPE_CLOSED, done.stderr
    assert done.stderr == "", done.stderr
