"""Failure tests with reaper subprocesses: SIGKILL, SIGSTOP/SIGCONT, Kafka restart, Postgres restart.

Restarts use PRIVATE service instances (tests/support/private_services.py), never the shared ones.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
import uuid

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from support.harness import Generator, Receiver, check_published, env_for, make_config, order_violations, wait_until
from support.private_services import PrivateServices
from support.reaper import ReaperProcess, stop_all
from support.recovery import resume_gap

from tracker import schema as schema_mod

PARTITIONS = 3
# A restart longer than the session (3 s here) waits for the old membership to expire on the
# restarted coordinator: about session_timeout + 1 s (README "Recovery after a Kafka or Postgres restart").
# The limits catch a regression to the clients' own timeouts (30-60 s), with room for a loaded
# machine; the recovery goals themselves are measured by bench/harvest_recovery.py.
KAFKA_GAP_LIMIT = 20.0
POSTGRES_GAP_LIMIT = 8.0  # goal 1 s
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reaper-failover")]


def _setup(pg_dsn, schema, bootstrap, topic_maker, **harvester):
    topic = topic_maker("data", partitions=PARTITIONS)
    leader_topic = topic_maker("leader", partitions=1)
    cfg = make_config(
        pg_dsn,
        schema,
        bootstrap,
        leader_topic=leader_topic,
        harvester={"mark_batch": 500, "max_in_flight": 2000, **harvester},
    )
    return topic, env_for(cfg)


def test_sigkill_of_the_leader_mid_stream(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    topic, env = _setup(pg_dsn, schema, kafka_bootstrap, topics)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(pg_dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=1000)
    a = ReaperProcess(env, tmp_path / "a.log")
    b = None
    try:
        assert a.wait_leader(60)
        b = ReaperProcess(env, tmp_path / "b.log")  # the standby joins once a leads
        time.sleep(3)
        a.signal(signal.SIGKILL)
        a.wait(10)
        killed = time.monotonic()
        assert b.wait_leader(30), "the standby never took over"
        gap = time.monotonic() - killed
        time.sleep(2)
        gen.stop()
        check_published(receiver, gen)
        print(f"failover after SIGKILL: {gap:.2f}s (session timeout 3 s)")
    finally:
        gen.stop()
        stop_all([p for p in (a, b) if p is not None])
        receiver.close()


AUDIT = """
CREATE TABLE mark_audit (row_id bigint, leader_id uuid, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION audit_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO {schema}.mark_audit (row_id, leader_id) VALUES (NEW.id, NEW.leader_id); RETURN NEW; END $$;
CREATE TRIGGER audit_mark AFTER UPDATE OF leader_id ON outbox FOR EACH ROW WHEN (NEW.leader_id IS NOT NULL)
EXECUTE FUNCTION audit_mark();
"""


def _ids(proc: ReaperProcess) -> set[str]:
    return {e["leader_id"] for e in proc.events() if e.get("leader_id")}


def _acquired_at(proc: ReaperProcess) -> dt.datetime:
    ts = [e["timestamp"] for e in proc.events() if e.get("event") == "neli leader"][0]
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00"))


@pytest.mark.parametrize("transactions", [False, True], ids=["idempotent", "transactional"])
def test_sigstopped_leader_publishes_nothing_after_another_took_over(
    pg_dsn, kafka_bootstrap, schema, topics, tmp_path, transactions
):
    """With harvester.transactional_id the broker also refuses whatever the resumed process's
    librdkafka still held (see test_harvester_transactions for that case made deterministic)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'SET search_path TO "{schema}"')
        conn.execute(AUDIT.replace("{schema}", f'"{schema}"'))
    extra = {"transactional_id": f"reaper-test-{uuid.uuid4().hex[:10]}"} if transactions else {}
    topic, env = _setup(pg_dsn, schema, kafka_bootstrap, topics, **extra)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(pg_dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=1000)
    a = ReaperProcess(env, tmp_path / "a.log")
    b = None
    try:
        assert a.wait_leader(60)
        b = ReaperProcess(env, tmp_path / "b.log")  # the standby joins once a leads
        time.sleep(2)
        a.signal(signal.SIGSTOP)  # longer than heartbeat (1 s) and session (3 s) timeouts
        assert b.wait_leader(30), "the standby never took over from the stopped leader"
        time.sleep(2)
        a.signal(signal.SIGCONT)
        # The resumed process sees its leadership void at once and steps down.
        assert wait_until(lambda: not a.is_leader(), 15), "the resumed leader never stepped down"
        time.sleep(3)
        gen.stop()
        check_published(receiver, gen)
        assert b.is_leader()
        took_over = _acquired_at(b)
        a_ids = _ids(a)
        with psycopg.connect(pg_dsn) as conn:
            late = conn.execute(
                f'SELECT count(*), max(at) FROM "{schema}".mark_audit WHERE leader_id = ANY(%s::uuid[]) AND at >= %s',
                [list(a_ids), took_over],
            ).fetchone()
            b_marks = conn.execute(
                f'SELECT count(*) FROM "{schema}".mark_audit WHERE leader_id = ANY(%s::uuid[])', [list(_ids(b))]
            ).fetchone()[0]
        assert late[0] == 0, f"the stopped leader marked {late[0]} rows after {took_over} (last {late[1]})"
        assert b_marks > 0
        # Records handed to the producer: unchanged from the moment it stepped down to its exit.
        states = [e for e in a.events() if e.get("event") == "publishing state"]
        after_stop = [e for e in states if e["state"] != "leader"]
        assert after_stop, states
        assert len({e["records_produced"] for e in after_stop}) == 1, after_stop
        # Records it had handed to librdkafka before the stop may still be acknowledged once it is
        # resumed (librdkafka's own threads send them): duplicates of rows the new leader republishes.
        late_acks = after_stop[-1]["records_delivered"] - after_stop[0]["records_delivered"]
        print(f"stale leader: records acknowledged after it stepped down: {late_acks}")
    finally:
        gen.stop()
        stop_all([p for p in (a, b) if p is not None])
        receiver.close()


@pytest.fixture
def private():
    svc = PrivateServices()
    yield svc
    svc.destroy()


def test_kafka_broker_restart_mid_stream(pg_dsn, schema, private, tmp_path):
    private.up(only="kafka")
    admin = AdminClient({"bootstrap.servers": private.bootstrap})
    topic, leader_topic = f"data-{uuid.uuid4().hex[:8]}", f"leader-{uuid.uuid4().hex[:8]}"
    for f in admin.create_topics(
        [
            NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1),
            NewTopic(leader_topic, num_partitions=1, replication_factor=1),
        ]
    ).values():
        f.result(30)
    cfg = make_config(
        pg_dsn,
        schema,
        private.bootstrap,
        leader_topic=leader_topic,
        harvester={"mark_batch": 500, "max_in_flight": 2000},
    )
    a = ReaperProcess(env_for(cfg), tmp_path / "a.log")
    gen = Generator(pg_dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=500)
    receiver = None
    try:
        assert a.wait_leader(60)
        time.sleep(2)
        private.down(only="kafka")
        time.sleep(2)
        private.up(only="kafka")
        gap = resume_gap(pg_dsn, schema, time.monotonic())
        print(f"publishing resumed {gap:.3f} s after Kafka answered again")
        # Generous for a loaded CI machine.
        assert gap < KAFKA_GAP_LIMIT, f"publishing resumed {gap:.3f} s after Kafka answered again"
        gen.stop()
        receiver = Receiver(private.bootstrap, topic, PARTITIONS)
        check_published(receiver, gen, timeout=180)
        assert a.proc.poll() is None, "the reaper exited when the broker went away"
        events = [e.get("event") for e in a.events()]
        assert "neli fenced" in events or "neli follower" in events, "no fence while the broker was down"
    finally:
        gen.stop()
        stop_all([a])
        if receiver is not None:
            receiver.close()


def test_postgres_restart_mid_stream(kafka_bootstrap, topics, private, tmp_path):
    """Publishing resumes within about a second of Postgres accepting connections again, and a
    standby whose pooled connections all died meanwhile takes over without one failed mark."""
    private.up(only="postgres")
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(private.dsn, name)
    topic, env = _setup(private.dsn, name, kafka_bootstrap, topics)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(private.dsn, name, topic, keys=30, per_txn=10).start(rate_per_s=500)
    a = ReaperProcess(env, tmp_path / "a.log")
    b = None
    try:
        assert a.wait_leader(60)
        b = ReaperProcess(env, tmp_path / "b.log")
        time.sleep(4)  # b has joined the group and opened its pool: a standby
        assert not b.is_leader()
        private.down(only="postgres")
        time.sleep(4)  # long enough for psycopg_pool's own back-off to reach 4 s between attempts
        private.up(only="postgres")
        gap = resume_gap(private.dsn, name, time.monotonic())
        print(f"publishing resumed {gap:.3f} s after Postgres accepted connections again")
        # Goal 1 s; generous for a loaded CI machine.
        assert gap < POSTGRES_GAP_LIMIT, f"publishing resumed {gap:.3f} s after Postgres accepted connections again"
        time.sleep(1)
        a.terminate()  # the standby, idle through the restart, leads now
        assert b.wait_leader(30)
        assert wait_until(lambda: any(e.get("event") == "leading: marking from the head" for e in b.events()), 30)
        time.sleep(2)
        gen.stop()
        check_published(receiver, gen, timeout=120)
        with psycopg.connect(private.dsn) as conn:
            assert wait_until(lambda: conn.execute(f'SELECT count(*) FROM "{name}".outbox').fetchone()[0] == 0, 60)
        assert b.proc.poll() is None, "the reaper exited when the database went away"
        failed = [e for e in b.events() if e.get("event") in ("mark failed", "purge failed", "reset failed")]
        assert failed == [], f"the new leader used dead pooled connections: {failed[:3]}"
    finally:
        gen.stop()
        stop_all([p for p in (a, b) if p is not None])
        receiver.close()
