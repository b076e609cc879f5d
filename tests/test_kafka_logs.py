"""Every Kafka client `reaper run` creates logs through structlog: stderr holds JSON lines only,
never librdkafka's raw `%3|...|FAIL|...` lines glued between them."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support.harness import env_for, make_config, wait_until
from support.ports import free_port
from support.reaper import ReaperProcess
from support.tcp_proxy import KafkaProxy

from harvester.logs import ConnectionChatter

REPO = Path(__file__).resolve().parents[1]


def start(env: dict[str, str]) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    full.update({"REAPER_METRICS__ENABLED": "false", "REAPER_LOGGING__FORMAT": "json", "PYTHONUNBUFFERED": "1"})
    full.update(env)
    return subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "run"],
        cwd=REPO,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _parsed(lines: list[str]) -> list[dict]:
    """The JSON objects among `lines` so far (a line still being written is skipped)."""
    parsed = []
    for line in list(lines):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            parsed.append(event)
    return parsed


def json_lines(stderr: str) -> list[dict]:
    events = []
    for line in stderr.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            raise AssertionError(f"a stderr line that is not JSON: {line!r}\n--- all stderr:\n{stderr}") from None
        assert isinstance(event, dict) and "event" in event and "level" in event, line
        events.append(event)
    return events


def test_unreachable_broker_gives_json_lines_only_and_exit_3(pg_dsn, schema, kafka_bootstrap):
    cfg = make_config(pg_dsn, schema, kafka_bootstrap)
    env = env_for(cfg) | {
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "REAPER_DATABASE__STARTUP_TIMEOUT": "0",  # one try, no wait
    }
    proc = start(env)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    events = json_lines(err)
    assert out == ""
    assert any(e["event"] == "cannot start" and "Kafka unreachable" in e["error"] for e in events), events
    kafka = [e for e in events if e["event"] == "librdkafka"]
    assert kafka and {e["client"] for e in kafka} == {"admin"}, kafka
    assert any("Connection refused" in e["message"] for e in kafka), kafka


def test_every_kafka_client_of_a_running_reaper_logs_through_structlog(pg_dsn, schema, kafka_bootstrap, topics):
    # One good broker and one dead address: every client (admin, leader consumer, heartbeat
    # producer, harvester producer, acker consumer, dead-letter producer) starts; those that try
    # the dead one log FAIL lines. A consumer-only and a producer-only setting in kafka.client make
    # every client log a CONFWARN line at creation, so each one is seen to log through structlog.
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"))
    ack_topic = topics("acks")
    env = env_for(cfg) | {
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": f"{kafka_bootstrap},127.0.0.1:{free_port()}",
        "REAPER_ACKER__TOPIC": ack_topic,
        "REAPER_ACKER__GROUP": f"g-{ack_topic}",
        "REAPER_ACKER__DEAD_LETTER_TOPIC": topics("dlq"),
        "REAPER_SWEEPER__INTERVAL": "0.5",
        "REAPER_KAFKA__CLIENT__FETCH_WAIT_MAX_MS": "100",
        "REAPER_KAFKA__CLIENT__QUEUE_BUFFERING_MAX_MS": "5",
    }
    every_client = {
        "admin",
        "leader-admin",
        "leader-consumer",
        "heartbeat-producer",
        "producer",
        "acker-consumer",
        "dead-letter-producer",
    }
    proc = start(env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()

    def all_seen() -> bool:
        events = _parsed(lines)
        seen = {e.get("client") for e in events if e.get("event") == "librdkafka"}
        refused = any("Connection refused" in e.get("message", "") for e in events)
        return every_client <= seen and refused and any(e.get("event") == "acker started" for e in events)

    try:
        # Every client logs while the reaper runs, not only when it stops (the dead-letter
        # producer's lines waited for the stop before the acker polled it). Waited for, not a
        # fixed time: a loaded machine starts the acker late.
        running_seen = wait_until(all_seen, 90, step=0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # never left running; the return code below says it did not stop
            proc.wait()
        reader.join(10)  # the reader alone reads stderr (communicate() would race it)
        proc.stdout.close()  # nothing is written there (the first test checks it)
    err = "".join(lines)
    assert proc.returncode == 0, err[-3000:]
    events = json_lines(err)
    clients = {e["client"] for e in events if e["event"] == "librdkafka"}
    assert every_client <= clients, clients
    assert running_seen, "a client's lines came only after the stop"
    assert any(e["event"] == "acker started" for e in events)
    assert any("Connection refused" in e.get("message", "") for e in events), "no client tried the dead broker"


def test_a_broker_away_and_back_is_one_warning_and_one_info_per_client(
    pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    """While the broker is away, librdkafka's clients try to reconnect many times a second; the log
    holds one warning per client and broker when it goes and one info line with the count of
    failures not logged once they stop, never an error line per attempt."""
    proxy = KafkaProxy(kafka_bootstrap)
    cfg = make_config(pg_dsn, schema, proxy.address, leader_topic=topics("leader"))
    reaper = ReaperProcess(env_for(cfg), tmp_path / "reaper.log")
    try:
        assert reaper.wait_leader(60), reaper.log_path.read_text()[-3000:]
        proxy.down()
        time.sleep(8)
        proxy.up()
        stopped = lambda: [e for e in reaper.events() if e.get("event") == "Kafka connection failures stopped"]  # noqa: E731
        assert wait_until(lambda: {e["client"] for e in stopped()} >= {"leader-consumer", "heartbeat-producer"}, 60)
        assert wait_until(reaper.is_leader, 60), "never led again after the broker came back"
    finally:
        code = reaper.terminate(60)
        proxy.close()
    assert code == 0
    text = reaper.log_path.read_text()
    events = json_lines(text)
    kafka = [e for e in events if e["event"] == "librdkafka"]
    trouble = [e for e in kafka if ConnectionChatter.is_trouble(e["message"])]
    assert trouble, kafka
    assert all(e["level"] == "warning" for e in trouble), [e for e in trouble if e["level"] != "warning"]
    per_broker = collections.Counter((e["client"], e["broker"]) for e in trouble)
    assert max(per_broker.values()) == 1, per_broker
    back = [e for e in events if e["event"] == "Kafka connection failures stopped"]
    assert all(e["level"] == "info" for e in back)
    assert sum(e["failures_not_logged"] for e in back) > 0, back
