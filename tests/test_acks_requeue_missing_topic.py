"""`reaper acks requeue --at P:O` when the dead-letter topic does not exist: exit 5 (NOT_FOUND, as
the exit-code reference says for this command) with a message saying the topic does not exist,
naming it and its key, not that the topic "has none"."""

from __future__ import annotations

import os
import uuid

from support.reaper import run_cli

from harvester.exit_codes import ExitCode


def test_a_missing_dead_letter_topic_is_said_to_be_missing(pg_dsn, schema, kafka_bootstrap):
    topic = f"never-made-{uuid.uuid4().hex[:12]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(
        REAPER_DATABASE__DSN=pg_dsn,
        REAPER_DATABASE__SCHEMA=schema,
        REAPER_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        REAPER_ACKER__DEAD_LETTER_TOPIC=topic,
    )
    r = run_cli(["acks", "requeue", "--at", "0:0", "--dry-run"], env)
    assert r.returncode == ExitCode.NOT_FOUND, r.stderr
    assert f"the dead-letter topic {topic} (acker.dead_letter_topic) does not exist" in r.stderr, r.stderr
    assert "has none" not in r.stderr


def test_the_exit_code_reference_names_the_case():
    assert "`acks requeue --at`" in ExitCode.NOT_FOUND.meaning
    assert "dead-letter topic does not exist" in ExitCode.NOT_FOUND.meaning
