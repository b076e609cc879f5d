"""How long the reaper's clients (the election's, the data producer, the ackers') wait on a silent
broker: derived from the election's settings, bounded by them, and still overridden by the kafka.client / kafka.consumer / kafka.producer
passthrough settings (no service is contacted: the clients are only configured)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from harvester.election.neli import Neli
from harvester.election.timeouts import election_client_defaults, silent_broker_wait_ms
from harvester.metrics import get as get_metrics
from harvester.publishing.publisher import producer_config
from harvester.services.acker import Acker

times = st.floats(min_value=0.01, max_value=3600, allow_nan=False)


@given(times, times)
def test_the_wait_is_the_session_timeout(hb, session):
    wait = silent_broker_wait_ms(hb, session)
    assert wait == max(1000, int(max(hb, session) * 1000))  # heartbeat_timeout < session_timeout by config
    defaults = election_client_defaults(hb, session)
    assert defaults["socket.timeout.ms"] == defaults["socket.connection.setup.timeout.ms"] == wait
    assert 100 <= defaults["topic.metadata.refresh.interval.ms"] <= 1000


def _neli(client: dict, consumer: dict, producer: dict) -> Neli:
    return Neli(
        bootstrap="127.0.0.1:9",
        client=client,
        consumer=consumer,
        producer=producer,
        topic="t",
        group="g",
        min_poll_interval=0.1,
        heartbeat_timeout=5.0,
        session_timeout=15.0,
        metrics=get_metrics(),
    )


def test_election_clients_get_the_derived_waits():
    n = _neli({}, {}, {})
    for conf in (n._consumer_conf, n._producer_conf):
        assert conf["socket.timeout.ms"] == 15000
        assert conf["socket.connection.setup.timeout.ms"] == 15000
        assert conf["topic.metadata.refresh.interval.ms"] == 1000
    assert n._producer_conf["request.timeout.ms"] == 15000  # a late heartbeat answer still counts


def test_passthrough_settings_override_the_derived_waits():
    n = _neli({"socket.timeout.ms": 7000}, {"socket.timeout.ms": 8000}, {"socket.connection.setup.timeout.ms": 9000})
    assert n._consumer_conf["socket.timeout.ms"] == 8000  # kafka.consumer over kafka.client
    assert n._producer_conf["socket.timeout.ms"] == 7000  # kafka.client over the default
    assert n._producer_conf["socket.connection.setup.timeout.ms"] == 9000
    assert n._consumer_conf["socket.connection.setup.timeout.ms"] == 15000


def test_the_data_producer_waits_as_told_unless_configured_otherwise():
    conf = producer_config("b", {}, {}, silent_wait_ms=5000)
    assert conf["socket.timeout.ms"] == conf["request.timeout.ms"] == conf["socket.connection.setup.timeout.ms"] == 5000
    assert conf["topic.metadata.refresh.interval.ms"] == 1000
    conf = producer_config("b", {"request.timeout.ms": 30000}, {"socket.timeout.ms": 60000}, silent_wait_ms=5000)
    assert conf["request.timeout.ms"] == 30000 and conf["socket.timeout.ms"] == 60000
    assert "socket.timeout.ms" not in producer_config("b", {}, {})  # librdkafka's own without a wait


def _acker(client: dict, consumer: dict, producer: dict, silent_wait_ms: int | None = 15000) -> Acker:
    return Acker(
        dsn="postgresql://unused",
        schema="s",
        bootstrap_servers="127.0.0.1:9",
        kafka_client=client,
        consumer_client=consumer,
        producer_client=producer,
        topic="acks",
        group="g",
        dead_letter_topic="dlq",
        silent_wait_ms=silent_wait_ms,
    )


def test_the_ackers_clients_wait_as_told_unless_configured_otherwise():
    """The ack consumer and the dead-letter producer give a silent broker up as the data producer
    does (a consumer has no request.timeout.ms: librdkafka warns about one it is given)."""
    a = _acker({}, {}, {})
    for conf in (a._consumer_conf, a._producer_conf):
        assert conf["socket.timeout.ms"] == conf["socket.connection.setup.timeout.ms"] == 15000
        assert conf["topic.metadata.refresh.interval.ms"] == 1000
    assert a._producer_conf["request.timeout.ms"] == 15000 and "request.timeout.ms" not in a._consumer_conf
    a = _acker(
        {"socket.timeout.ms": 30000}, {"topic.metadata.refresh.interval.ms": 5000}, {"request.timeout.ms": 20000}
    )
    assert a._consumer_conf["socket.timeout.ms"] == a._producer_conf["socket.timeout.ms"] == 30000
    assert a._consumer_conf["topic.metadata.refresh.interval.ms"] == 5000
    assert a._producer_conf["topic.metadata.refresh.interval.ms"] == 1000
    assert a._producer_conf["request.timeout.ms"] == 20000
    plain = _acker({}, {}, {}, silent_wait_ms=None)  # librdkafka's own without a wait
    assert "socket.timeout.ms" not in plain._consumer_conf and "socket.timeout.ms" not in plain._producer_conf
