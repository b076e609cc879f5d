"""`reaper run` runs an acker for every schema of its outboxes that has batch tables and an ack
topic: acks read from one schema's topic clear bits in that schema only, and its completion events
go to that schema's outbox; each acker's log lines and metrics carry its schema."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest
from confluent_kafka import Producer
from support.acking import batch_state, closed_batch
from support.harness import make_config, wait_until
from support.ports import free_port
from support.reaper import ReaperProcess
from support.teardown import drop_schema
from test_harvester_cli import _safe_get
from test_tracker_support import completion_events

from harvester import config as config_mod
from harvester.config import ConfigError, ack_topics, acker_group
from tracker import schema as schema_mod


def _cfg(outboxes: list[dict], **acker) -> config_mod.Config:
    return config_mod.load(
        None,
        environ={},
        overrides={
            "database": {"schema": "main"},
            "harvester": {"outboxes": outboxes},
            "acker": {"topic": "acks", "dead_letter_topic": "acks-dlq", **acker},
        },
    )


def test_ack_topic_is_validated_naming_the_entry_key():
    good = _cfg([{"name": "main"}, {"name": "b", "schema": "second", "ack_topic": "acks-second"}])
    assert ack_topics(good) == {
        (good.database.dsn, "main"): "acks",
        (good.database.dsn, "second"): "acks-second",
    }
    assert (
        acker_group(good, "acks") == "reaper-acker" and acker_group(good, "acks-second") == "reaper-acker-acks-second"
    )
    # two entries of one schema that both name it must agree; one that leaves it out takes the other's
    twins = [{"name": "b", "schema": "s2", "ack_topic": "x"}, {"name": "c", "schema": "s2", "table": "outbox_c"}]
    assert len(ack_topics(_cfg(twins))) == 2
    # the `database` section's schema may repeat acker.topic, nothing else
    _cfg([{"name": "main", "ack_topic": "acks"}])
    bad = [
        (
            [{"name": "a"}, {"name": "b", "schema": "s2", "ack_topic": "no spaces"}],
            "[1].ack_topic",
            "valid Kafka topic",
        ),
        ([{"name": "b", "schema": "s2", "ack_topic": 7}], "[0].ack_topic", "topic name"),
        ([{"name": "b", "schema": "s2", "ack_topic": ""}], "[0].ack_topic", "valid Kafka topic"),
        ([{"name": "a", "ack_topic": "other"}], "[0].ack_topic", "acker.topic"),
        (
            [{"name": "b", "schema": "s2", "ack_topic": "acks"}],
            "[0].ack_topic",
            "already the ack topic of schema 'main'",
        ),
        ([{"name": "b", "schema": "s2", "ack_topic": "acks-dlq"}], "[0].ack_topic", "acker.dead_letter_topic"),
        (
            [
                {"name": "b", "schema": "s2", "ack_topic": "x"},
                {"name": "c", "schema": "s2", "table": "outbox_c", "ack_topic": "y"},
            ],
            "[1].ack_topic",
            "disagrees",
        ),
        (
            [{"name": "b", "schema": "s2", "ack_topic": "x"}, {"name": "c", "schema": "s3", "ack_topic": "x"}],
            "[1].ack_topic",
            "already the ack topic of schema 's2'",
        ),
    ]
    for outboxes, where, words in bad:
        with pytest.raises(ConfigError) as err:
            _cfg(outboxes)
        assert err.value.key == f"harvester.outboxes{where}", (outboxes, err.value)
        assert words in str(err.value), (outboxes, err.value)


def test_no_topic_the_reaper_writes_events_to_or_elects_on_is_an_ack_topic():
    """Completion and expiry events, or leadership records, on an ack topic would be read as acks."""
    outboxes = [{"name": "main"}, {"name": "b", "schema": "s2", "ack_topic": "acks-s2"}]
    for section, key in (
        ("harvester", "default_completion_topic"),
        ("sweeper", "expiry_topic"),
        ("harvester", "leader_topic"),
    ):
        for topic in ("acks", "acks-s2", "acks-dlq"):
            sections: dict = {
                "database": {"schema": "main"},
                "harvester": {"outboxes": outboxes},
                "acker": {"topic": "acks", "dead_letter_topic": "acks-dlq"},
            }
            sections.setdefault(section, {})[key] = topic
            with pytest.raises(ConfigError) as err:
                config_mod.load(None, environ={}, overrides=sections)
            assert err.value.key == f"{section}.{key}" and repr(topic) in str(err.value), err.value


def test_each_schema_acks_on_its_own_topic_and_completes_into_its_own_outbox(
    pg_dsn, schema, kafka_bootstrap, topics, tmp_path
):
    other, unacked = f"t_{uuid.uuid4().hex[:12]}", f"t_{uuid.uuid4().hex[:12]}"
    for s in (other, unacked):
        schema_mod.migrate(pg_dsn, s)
    main_acks, other_acks, dlq = topics("acks"), topics("acks-other"), topics("dlq")
    group = f"acker-{uuid.uuid4().hex[:8]}"
    port = free_port()
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        harvester={
            "enabled": False,
            "outboxes": [
                {"name": "main", "schema": schema},
                {"name": "second", "schema": other, "ack_topic": other_acks},
                {"name": "third", "schema": unacked},
            ],
        },
        acker={"enabled": True, "topic": main_acks, "group": group, "dead_letter_topic": dlq},
    )
    env = {
        "REAPER_DATABASE__DSN": pg_dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "REAPER_HARVESTER__ENABLED": "false",
        "REAPER_HARVESTER__OUTBOXES": json.dumps(cfg.harvester.outboxes),
        "REAPER_ACKER__ENABLED": "true",
        "REAPER_ACKER__TOPIC": main_acks,
        "REAPER_ACKER__GROUP": group,
        "REAPER_ACKER__DEAD_LETTER_TOPIC": dlq,
        "REAPER_METRICS__ENABLED": "true",
        "REAPER_METRICS__HOST": "127.0.0.1",
        "REAPER_METRICS__PORT": str(port),
    }
    # The same batch id in both schemas: an ack names a batch of whichever schema reads it.
    a, (ha,) = closed_batch(pg_dsn, schema, 10)
    b, (hb,) = closed_batch(pg_dsn, other, 10)
    assert a.id == b.id and ha.group_id == hb.group_id
    reaper = ReaperProcess(env, tmp_path / "reaper.log")
    try:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(other_acks, key=str(b.id).encode(), value=f"{b.id}:{hb.group_id}:0-9".encode())
        assert producer.flush(30) == 0
        assert wait_until(lambda: batch_state(pg_dsn, other, b.id)[0] == "complete", 60)
        assert batch_state(pg_dsn, schema, a.id) == ("closed", 10)  # the other schema's ack never touched it
        producer.produce(main_acks, key=str(a.id).encode(), value=f"{a.id}:{ha.group_id}:0-4".encode())
        assert producer.flush(30) == 0
        assert wait_until(lambda: batch_state(pg_dsn, schema, a.id) == ("closed", 5), 60)
        assert batch_state(pg_dsn, other, b.id) == ("complete", 0)
        metrics = _safe_get(f"http://127.0.0.1:{port}/metrics")[1]
        for s in (schema, other):
            assert f'reaper_acker_lag_messages{{schema="{s}"}}' in metrics, metrics
        assert f'schema="{unacked}"' not in metrics.split("reaper_acker_lag_messages", 1)[1].split("# HELP", 1)[0]
        assert reaper.terminate(60) == 0
    finally:
        reaper.kill()
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            events_other = completion_events(c, other)
            events_main = completion_events(c, schema)
            for s in (other, unacked):
                drop_schema(pg_dsn, s, if_exists=False)
    assert events_main == []  # batch a is not finished
    ((key, value),) = events_other
    assert key == str(b.id).encode() and json.loads(value)["batch_id"] == b.id
    events = reaper.events()
    started = {e["schema"]: e for e in events if e.get("event") == "acker started"}
    assert set(started) == {schema, other}, started
    assert started[schema]["topic"] == main_acks and started[schema]["group"] == group
    assert started[other]["topic"] == other_acks and started[other]["group"] == f"{group}-{other_acks}"
    (missing,) = [e for e in events if e.get("event", "").startswith("schemas with batch tables but no ack topic")]
    assert missing["schemas"] == [unacked]
