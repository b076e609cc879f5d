"""A topic whose max.message.bytes is below the producer's message.max.bytes. A batch over the
topic's limit is refused by the broker (failing the idempotent producer for good, or the
transaction): its rows are published again until the topic takes them, and an error line names the
topic, its limit and the producer setting that makes produce() itself refuse larger records. With
that setting below the topic's limit, such a record is moved to the dead table as soon as it is
produced and holds up nothing; both publishing modes."""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
from structlog.testing import capture_logs
from support.harness import Receiver, make_config, running, wait_until

LIMIT = 10_000


def _insert(pg_dsn: str, schema: str, rows: list[tuple[str, bytes, bytes]]) -> list[int]:
    with psycopg.connect(pg_dsn) as c:
        return [
            c.execute(
                f'INSERT INTO "{schema}".outbox (topic, key, value) VALUES (%s, %s, %s) RETURNING id', list(row)
            ).fetchone()[0]
            for row in rows
        ]


@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
def test_with_the_producer_limit_below_the_topics_a_larger_row_is_moved_aside_at_once(
    pg_dsn, kafka_bootstrap, schema, topics, fenced
):
    small = topics("small", partitions=1, config={"max.message.bytes": str(LIMIT)})
    other = topics("other", partitions=1)
    rows = [(small, b"s", b"s0"), (small, b"s", os.urandom(2 * LIMIT)), (other, b"o", b"o0")]
    rows += [(small, b"s", b"s%d" % i) for i in range(1, 5)] + [(other, b"o", b"o%d" % i) for i in range(1, 5)]
    ids = _insert(pg_dsn, schema, rows)
    read_committed = {"isolation.level": "read_committed"}
    got_small = Receiver(kafka_bootstrap, small, 1, read_committed)
    got_other = Receiver(kafka_bootstrap, other, 1, read_committed)
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    kafka = {"bootstrap_servers": kafka_bootstrap, "producer": {"message.max.bytes": LIMIT - 1000}}
    try:
        with running(make_config(pg_dsn, schema, kafka_bootstrap, harvester=fencing, kafka=kafka)) as h:
            assert wait_until(
                lambda: (
                    {b"o%d" % i for i in range(5)} <= set(got_other.values())
                    and {b"s%d" % i for i in range(5)} <= set(got_small.values())
                ),
                60,
            ), (sorted(set(got_other.values())), sorted(set(got_small.values())))
            assert h.publisher.retired == 0, "a producer failed for a record produce() could have refused"
        with psycopg.connect(pg_dsn) as c:
            dead = c.execute(f'SELECT id, reason FROM "{schema}".outbox_dead').fetchall()
        ((dead_id, reason),) = dead
        assert dead_id == ids[1] and reason.startswith("MSG_SIZE_TOO_LARGE"), dead
        small_values = [v for v in got_small.values() if v.startswith(b"s")]
        assert sorted(set(small_values), key=small_values.index) == [b"s%d" % i for i in range(5)]
    finally:
        got_small.close()
        got_other.close()


@pytest.mark.parametrize("fenced", [False, True], ids=["idempotent", "transactional"])
def test_a_batch_the_topic_refuses_for_its_size_says_what_to_set(pg_dsn, kafka_bootstrap, schema, topics, fenced):
    """Nothing is moved aside (the broker judges the compressed batch: which record it can never
    take, no size tells); the error line names the topic's limit and the producer's."""
    small = topics("small", partitions=1, config={"max.message.bytes": str(LIMIT)})
    _insert(pg_dsn, schema, [(small, b"s", b"s0"), (small, b"s", os.urandom(2 * LIMIT))])
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    with capture_logs() as logs, running(make_config(pg_dsn, schema, kafka_bootstrap, harvester=fencing)) as h:
        advice = lambda: [e for e in logs if "kafka.producer.message.max.bytes" in e["event"]]  # noqa: E731
        assert wait_until(lambda: advice(), 60), [e["event"] for e in logs][-20:]
        assert h.publisher.dead_rows == 0
    (line,) = advice()[:1]
    assert line["log_level"] == "error" and line["topic"] == small
    assert line["max_message_bytes"] == LIMIT and line["producer_message_max_bytes"] == 1_000_000
