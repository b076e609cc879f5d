"""A leader cut off from Postgres alone steps down, and joins again once Postgres answers.

Each reaper is a subprocess; the one to be cut off reaches Postgres through a TCP proxy of the
test's own (tests/support/tcp_proxy.py), which the test takes down: that reaper's connections
close and new ones are refused, while Kafka and the other reaper's Postgres stay up.
"""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from support.harness import Generator, Receiver, check_published, env_for, make_config, wait_until
from support.reaper import ReaperProcess, stop_all
from support.tcp_proxy import TcpProxy

PARTITIONS = 3
STEP_DOWN_AFTER = 2.0
STEPPED_DOWN = "database out of reach while Kafka is not: fencing and leaving the leader group"
REJOINED = "database answers again: rejoining the leader group"
ALONE = "database out of reach, but no other member to hand over to: keeping the partitions"
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reaper-failover")]


def _through(pg_dsn: str, proxy: TcpProxy) -> str:
    parts = conninfo_to_dict(pg_dsn)
    parts.update(host=proxy.host, port=str(proxy.port))
    return make_conninfo(**parts)


def _upstream(pg_dsn: str) -> str:
    parts = conninfo_to_dict(pg_dsn)
    return f"{parts.get('host') or '127.0.0.1'}:{parts.get('port') or 5432}"


def _setup(pg_dsn, schema, bootstrap, topics):
    topic = topics("data", partitions=PARTITIONS)
    cfg = make_config(
        pg_dsn,
        schema,
        bootstrap,
        leader_topic=topics("leader", partitions=1),
        harvester={"mark_batch": 500, "max_in_flight": 2000},
    )
    env = env_for(cfg) | {"REAPER_HARVESTER__STEP_DOWN_AFTER": str(STEP_DOWN_AFTER)}
    return topic, env


def _named(proc: ReaperProcess, event: str) -> list[dict]:
    return [e for e in proc.events() if e.get("event") == event]


def _published_since(receiver: Receiver, gen: Generator, committed_before: set) -> bool:
    """Some rows committed after `committed_before` was taken have arrived."""
    return bool((gen.committed - committed_before) & receiver.unique())


def _unique_leader_ids(*procs: ReaperProcess) -> None:
    ids = [i for p in procs for i in p.leader_ids()]
    assert len(ids) == len(set(ids)), f"a leader id was used for two acquisitions: {ids}"


def test_a_leader_cut_off_from_postgres_alone_hands_over_and_rejoins(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    topic, env = _setup(pg_dsn, schema, kafka_bootstrap, topics)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(pg_dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=500)
    a = b = None
    with TcpProxy(_upstream(pg_dsn)) as proxy:
        try:
            a = ReaperProcess(env | {"REAPER_DATABASE__DSN": _through(pg_dsn, proxy)}, tmp_path / "a.log")
            assert a.wait_leader(60)
            b = ReaperProcess(env, tmp_path / "b.log")  # the standby joins once a leads
            assert wait_until(lambda: bool(receiver.unique()), 60), "nothing was published before the cut"
            assert not b.is_leader()

            proxy.down()  # a alone loses Postgres; its Kafka side stays healthy
            assert b.wait_leader(90), "the other reaper never took over from the cut-off leader"
            assert _named(a, STEPPED_DOWN), "the cut-off leader never stepped down"
            assert not a.is_leader()
            during = set(gen.committed)
            assert wait_until(lambda: _published_since(receiver, gen, during), 60), (
                "rows written during the cut were not published by the new leader"
            )
            assert not _named(a, REJOINED), "the cut-off reaper rejoined while its database was out of reach"

            proxy.up()
            assert wait_until(lambda: bool(_named(a, REJOINED)), 90), "the reaper never rejoined"
            assert a.proc.poll() is None and b.proc.poll() is None
            assert b.is_leader(), "leadership moved back to the rejoined reaper"
            time.sleep(2)
            gen.stop()
            check_published(receiver, gen, timeout=120)
            with psycopg.connect(pg_dsn) as conn:
                left = lambda: conn.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0]  # noqa: E731
                assert wait_until(lambda: left() == 0, 60), "rows were left in the outbox"
            assert len(_named(a, STEPPED_DOWN)) == 1
            _unique_leader_ids(a, b)
        finally:
            gen.stop()
            stop_all([p for p in (a, b) if p is not None])
            receiver.close()


def test_a_lone_reaper_that_loses_postgres_keeps_its_partition_and_leads_on_once_it_answers(
    pg_dsn, kafka_bootstrap, schema, topics, tmp_path
):
    """With no other member to hand over to, leaving the group only delays the return: a consumer
    joining an empty group waits out group.initial.rebalance.delay.ms (3 s on a default broker)."""
    topic, env = _setup(pg_dsn, schema, kafka_bootstrap, topics)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(pg_dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=500)
    a = None
    with TcpProxy(_upstream(pg_dsn)) as proxy:
        try:
            a = ReaperProcess(env | {"REAPER_DATABASE__DSN": _through(pg_dsn, proxy)}, tmp_path / "a.log")
            assert a.wait_leader(60)
            proxy.down()
            # Cut off well past step_down_after, twice looked at: alone both times.
            assert wait_until(lambda: len(_named(a, ALONE)) >= 2, 90), "the reaper never found itself alone"
            assert not _named(a, STEPPED_DOWN), "a lone reaper stepped down"
            committed_before = set(gen.committed)
            proxy.up()
            assert wait_until(lambda: _published_since(receiver, gen, committed_before), 90), "no publishing after"
            gen.stop()
            check_published(receiver, gen, timeout=120)
            assert a.proc.poll() is None, "the reaper exited while its database was out of reach"
            assert not _named(a, STEPPED_DOWN) and a.is_leader()
            _unique_leader_ids(a)
        finally:
            gen.stop()
            stop_all([a] if a is not None else [])
            receiver.close()
