"""A completion topic Kafka would refuse to a producer is refused when the batch is opened (400,
naming the value as written), not accepted to fail when the completion event is published: Kafka's
internal topics (such as __consumer_offsets), '.' and '..'. Other names starting with '__' are
topics like any other (the reaper's own leader topic is one, refused for its own reason)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from support.http_server import TOKEN, RunningServer, http_config

from harvester.services.http.models import KAFKA_INTERNAL_TOPICS, CreateBatch

_NAME = st.text(alphabet="abcXYZ019._-", min_size=1, max_size=40)


@pytest.mark.parametrize("topic", sorted(KAFKA_INTERNAL_TOPICS))
def test_a_kafka_internal_topic_is_refused_naming_it(topic):
    with pytest.raises(ValidationError) as exc:
        CreateBatch(completion_topic=topic)
    assert repr(topic) in str(exc.value) and "internal" in str(exc.value)


@given(st.sampled_from(["", "_", "__"]), _NAME)
def test_other_names_kafka_takes_pass_this_check(prefix, name):
    topic = prefix + name
    if topic not in KAFKA_INTERNAL_TOPICS:
        assert CreateBatch(completion_topic=topic).completion_topic == topic


@pytest.mark.parametrize("topic", [".", "..", "__consumer_offsets", "__transaction_state"])
def test_opening_a_batch_into_a_topic_kafka_refuses_is_a_400_or_403_and_opens_nothing(pg_dsn, schema, topic):
    with (
        RunningServer(http_config(pg_dsn, schema), [TOKEN]) as s,
        httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as c,
    ):
        r = c.post("/v1/batches", json={"completion_topic": topic})
        assert r.status_code in (400, 403), (topic, r.status_code, r.text)
        assert r.json()["field"] == "body.completion_topic" and topic in r.json()["detail"]
        assert c.post("/v1/batches", json={"completion_topic": "a__b"}).json()["batch_id"] == 1  # the first batch
