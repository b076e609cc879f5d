"""Kafka's internal topics (__consumer_offsets, __transaction_state, ...) are valid names that the
broker refuses to every producer: a row naming one could never be published, and in both modes it
stopped the whole outbox. The tracker (every call that takes a topic) and the SQL functions refuse
them with the usual typed error naming the value, and change nothing; other names starting with
'__' are topics like any other (the reaper's own leader topic is `__reaper_leader`)."""

from __future__ import annotations

import psycopg
import pytest

import tracker
from harvester.config_schema import TOPIC
from tracker import outbox
from tracker.core.validate import check_topic, is_topic_name
from tracker.errors import InvalidValue

INTERNAL = [
    "__consumer_offsets",
    "__transaction_state",
    "__share_group_state",
    "__cluster_metadata",
    "__remote_log_metadata",
]


@pytest.mark.parametrize("topic", INTERNAL)
def test_the_tracker_refuses_kafkas_internal_topics_naming_the_value(topic):
    assert not is_topic_name(topic)
    with pytest.raises(InvalidValue) as got:
        check_topic(topic)
    assert got.value.name == "topic" and got.value.value == topic
    assert "one of Kafka's internal topics" in str(got.value) and topic in str(got.value)


@pytest.mark.parametrize("topic", ["__reaper_leader", "__orders", "_consumer_offsets", "__consumer_offsets_2"])
def test_other_names_starting_with_underscores_are_topics_like_any_other(topic):
    assert is_topic_name(topic) and check_topic(topic) == topic
    assert TOPIC.accepts(topic)  # the reaper's configuration (its default leader topic among them)


def test_outbox_enqueue_refuses_an_internal_topic_and_leaves_the_transaction_as_it_was(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        batch = tracker.open_batch(c, schema=schema)
        status = c.info.transaction_status
        with pytest.raises(InvalidValue) as got:
            outbox.enqueue(c, batch, [b"x"], topic="__consumer_offsets", key=b"k", schema=schema)
        assert got.value.value == "__consumer_offsets"
        assert c.info.transaction_status == status
        assert c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone() == (0,)
        with pytest.raises(InvalidValue):
            tracker.open_batch(c, completion_topic="__transaction_state", schema=schema)
        assert c.info.transaction_status == status
        c.rollback()


@pytest.mark.parametrize("topic", INTERNAL)
@pytest.mark.parametrize("call", ["enqueue", "open_batch"])
def test_the_sql_functions_refuse_an_internal_topic_with_rt007_naming_it(pg_dsn, schema, topic, call):
    with psycopg.connect(pg_dsn) as c:
        batch = c.execute(f'SELECT "{schema}".open_batch()').fetchone()[0]
        with pytest.raises(psycopg.errors.Error) as got:
            if call == "enqueue":
                c.execute(f'SELECT * FROM "{schema}".enqueue(%s, %s, ARRAY[%s]::bytea[])', [batch, topic, b"v"])
            else:
                c.execute(f'SELECT "{schema}".open_batch(completion_topic => %s)', [topic])
        assert got.value.sqlstate == "RT007", f"{got.value.sqlstate}: {got.value}"
        assert got.value.diag.message_detail == topic
        assert "one of Kafka's internal topics" in str(got.value)
