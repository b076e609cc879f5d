"""The tracker's silent-broker waits (tracker.kafka_waits) fit whatever the caller configures:
librdkafka itself (no broker needed: it checks a configuration as the client is made) accepts
every combination, and the caller's own settings win."""

from __future__ import annotations

from confluent_kafka import Consumer, Producer
from hypothesis import given, settings
from hypothesis import strategies as st

from tracker.consumer import AckProducer
from tracker.kafka_waits import SILENT_BROKER_WAIT_MS, with_waits

NOWHERE = "127.0.0.1:9"  # nothing is sent: making the client is what is checked


@settings(max_examples=40, deadline=None)
@given(transaction_timeout_ms=st.integers(1000, 900_000), own_socket=st.none() | st.integers(10, 300_000))
def test_a_transactional_producer_with_any_transaction_timeout_is_made(transaction_timeout_ms, own_socket):
    conf: dict[str, object] = {"transactional.id": "t", "transaction.timeout.ms": transaction_timeout_ms}
    if own_socket is not None and own_socket <= transaction_timeout_ms + 100:
        conf["socket.timeout.ms"] = own_socket
    merged = {"bootstrap.servers": NOWHERE, **with_waits(conf, producer=True)}
    Producer(merged).flush(0)  # librdkafka refused a socket timeout above the transaction's with the defaults on top
    assert merged["request.timeout.ms"] == SILENT_BROKER_WAIT_MS
    assert merged.get("socket.timeout.ms") == conf.get("socket.timeout.ms")


def test_an_ack_producer_may_be_transactional():
    AckProducer(
        bootstrap_servers=NOWHERE,
        topic="acks",
        kafka_client={"transactional.id": "acks-1", "transaction.timeout.ms": 10_000},
    )


@settings(max_examples=40, deadline=None)
@given(fetch_wait_ms=st.none() | st.integers(0, 300_000))
def test_a_consumer_socket_timeout_stays_past_its_fetch_wait(fetch_wait_ms):
    conf: dict[str, object] = {"group.id": "g"}
    if fetch_wait_ms is not None:
        conf["fetch.wait.max.ms"] = fetch_wait_ms
    merged = with_waits(conf, producer=False)
    assert "request.timeout.ms" not in merged  # a producer property
    assert merged["socket.timeout.ms"] == min(300_000, max(SILENT_BROKER_WAIT_MS, (fetch_wait_ms or 0) + 1000))
    assert {k: merged[k] for k in conf} == conf
    Consumer({"bootstrap.servers": NOWHERE, **merged}).close()


def test_the_callers_own_settings_win():
    conf = {"socket.timeout.ms": 5000, "request.timeout.ms": 7000}
    merged = with_waits(conf, producer=True)
    assert merged["socket.timeout.ms"] == 5000 and merged["request.timeout.ms"] == 7000
