"""A row larger than its topic's max.message.bytes, though smaller than the producer's own
message.max.bytes: produce() takes it, the broker refuses the batch it travels in (and under the
gap-less guarantee fails the producer). The row alone is moved to the dead table with its sizes;
the rows that shared its batch, and other topics' rows, are published; both publishing modes."""

from __future__ import annotations

import os
import uuid

import psycopg
import pytest
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
def test_a_row_over_its_topics_limit_is_moved_aside_and_holds_up_nothing(
    pg_dsn, kafka_bootstrap, schema, topics, fenced
):
    small = topics("small", partitions=1, config={"max.message.bytes": str(LIMIT)})
    other = topics("other", partitions=1)
    rows = [(small, b"s", b"s0"), (small, b"s", os.urandom(5 * LIMIT)), (other, b"o", b"o0")]
    rows += [(small, b"s", b"s%d" % i) for i in range(1, 5)] + [(other, b"o", b"o%d" % i) for i in range(1, 5)]
    ids = _insert(pg_dsn, schema, rows)
    read_committed = {"isolation.level": "read_committed"}
    got_small = Receiver(kafka_bootstrap, small, 1, read_committed)
    got_other = Receiver(kafka_bootstrap, other, 1, read_committed)
    fencing = {"transactional_id": f"t-{uuid.uuid4().hex[:8]}"} if fenced else {}
    try:
        with running(make_config(pg_dsn, schema, kafka_bootstrap, harvester=fencing), drain_timeout=3) as h:
            later = _insert(pg_dsn, schema, [(other, b"o", b"o%d" % i) for i in range(5, 10)])
            assert wait_until(
                lambda: (
                    {b"o%d" % i for i in range(10)} <= set(got_other.values())
                    and {b"s%d" % i for i in range(5)} <= set(got_small.values())
                ),
                60,
            ), (sorted(set(got_other.values())), sorted(set(got_small.values())))
            assert wait_until(lambda: h.publisher.dead_rows == 1, 10)
        with psycopg.connect(pg_dsn) as c:
            dead = c.execute(f'SELECT id, reason FROM "{schema}".outbox_dead').fetchall()
            left = c.execute(f'SELECT id FROM "{schema}".outbox').fetchall()
        ((dead_id, reason),) = dead
        assert dead_id == ids[1], dead
        assert reason.startswith("MSG_SIZE_TOO_LARGE: the record is ") and f"max.message.bytes ({LIMIT})" in reason
        assert left == [] and later
        # per key, the records kept their order around the one moved aside
        small_values = [v for v in got_small.values() if v.startswith(b"s")]
        assert sorted(set(small_values), key=small_values.index) == [b"s%d" % i for i in range(5)]
    finally:
        got_small.close()
        got_other.close()


def test_a_batch_over_the_topics_limit_though_its_records_fit_says_what_to_set(pg_dsn, kafka_bootstrap, schema, topics):
    """Small records batched past a small topic limit: none is moved aside, and an error line says
    to set kafka.producer.batch.size below the topic's limit."""
    from structlog.testing import capture_logs

    small = topics("small", partitions=1, config={"max.message.bytes": str(LIMIT)})
    _insert(pg_dsn, schema, [(small, b"s", b"%05d" % i) for i in range(20_000)])
    with capture_logs() as logs, running(make_config(pg_dsn, schema, kafka_bootstrap), drain_timeout=3) as h:
        assert wait_until(lambda: any("batch.size" in e["event"] for e in logs), 60), [e["event"] for e in logs][-20:]
        assert h.publisher.dead_rows == 0
    (line,) = [e for e in logs if "batch.size" in e["event"]]
    assert line["topic"] == small and line["max_message_bytes"] == LIMIT and line["log_level"] == "error"
