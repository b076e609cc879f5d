"""librdkafka's connection trouble lines, per client: one warning per broker outage, the rest
counted and reported once the failures stop (harvester.logs.ConnectionChatter)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from harvester.logs import QUIET_AFTER, ConnectionChatter, _broker_of

BROKERS = ["127.0.0.1:9092/1", "127.0.0.1:9093/2", "127.0.0.1:9092/bootstrap", "GroupCoordinator", "app"]


def _line(thread: str) -> str:
    return f"FAIL [rdkafka#producer-1] [thrd:{thread}]: {thread}: Connect to ipv4#x failed: Connection refused"


@given(st.lists(st.tuples(st.floats(0, 3 * QUIET_AFTER), st.sampled_from(BROKERS)), max_size=60))
def test_every_failure_is_logged_or_counted_and_a_broker_is_news_once_per_outage(steps):
    with capture_logs() as events:
        gate = ConnectionChatter("producer")
        now, admitted, lines = 1000.0, [], 0
        for dt, thread in steps:
            now += dt
            gate.tick(now)
            lines += 1
            if gate.admit(_line(thread), now):
                admitted.append(now)
        gate.tick(now + 1e6)  # long after: every outage is over
    stopped = [e for e in events if e["event"] == "Kafka connection failures stopped"]
    # each admitted line opened one outage, which one "stopped" line closes, with its count
    assert len(stopped) == len(admitted)
    assert len(admitted) + sum(e["failures_not_logged"] for e in stopped) == lines
    assert all(e["log_level"] == "info" for e in stopped)


def test_trouble_is_told_from_other_lines():
    assert ConnectionChatter.is_trouble(_line("127.0.0.1:9092/1"))
    assert ConnectionChatter.is_trouble("REQTMOUT [rdkafka#producer-1] [thrd:h:1/1]: h:1/1: Timed out 2 in-flight")
    assert ConnectionChatter.is_trouble(
        "ERROR [rdkafka#consumer-1] [thrd:app]: rdkafka#consumer-1: 1/1 brokers are down"
    )
    assert not ConnectionChatter.is_trouble("ERROR [rdkafka#producer-1] [thrd:app]: Topic authorization failed")
    assert not ConnectionChatter.is_trouble("CONFWARN [rdkafka#producer-1] [thrd:app]: Configuration property x")
    assert _broker_of(_line("127.0.0.1:9092/1")) == _broker_of(_line("127.0.0.1:9092/bootstrap")) == "127.0.0.1:9092"
    assert _broker_of(_line("app")) == "*"
