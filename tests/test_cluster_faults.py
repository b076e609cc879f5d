"""Faults of a production topology under load: three Kafka brokers (replication factor 3, min ISR
2) and a Postgres primary with a synchronous standby, with two reapers publishing and folding acks
while writers, fan-outs and consumers run. Each test injects one fault, heals it, and checks the
ledger: nothing committed lost, per key in order, every committed batch completed exactly once.

The cluster is shared by these tests (one worker: xdist_group) and healed after each.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pytest
from confluent_kafka import Producer
from support.cluster import QUIET, Cluster, ClusterTopics, Consumers, FanOuts, check_completions
from support.harness import FAST, Generator, Receiver, check_published, env_for, make_config, wait_until
from support.reaper import ReaperProcess, stop_all

import tracker
from harvester import config as config_mod
from tracker import schema as schema_mod
from tracker.ids import format_run

PARTITIONS = 3
SHORT_WAIT = {"socket.timeout.ms": 2000}
# The local cluster's broker.session.timeout.ms: Kafka moves a silent broker's leaderships after it.
BROKER_SESSION_S = 4.0
pytestmark = [pytest.mark.cluster, pytest.mark.xdist_group("cluster")]


@dataclass
class Load:
    cluster: Cluster
    schema: str
    topic: str
    item_topic: str
    gen: Generator
    fan: FanOuts
    consumers: Consumers
    data: Receiver
    completions: Receiver
    reapers: list[ReaperProcess]
    leader_topic: str
    leader_group: str
    ack_topic: str
    completion_topic: str

    def leads(self) -> bool:
        return any(r.is_leader() for r in self.reapers)

    def check(self) -> None:
        self.gen.stop()
        self.fan.stop()
        check_published(self.data, self.gen, timeout=120)
        check_completions(self.completions, self.fan, timeout=120)
        assert self.consumers.processed > 0


@pytest.fixture
def cluster_schema(cluster: Cluster) -> Iterator[str]:
    name = f"c_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(cluster.dsn, name)
    yield name
    try:
        with psycopg.connect(cluster.dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
    except psycopg.Error:
        pass  # the cluster is rebuilt around it; a leftover schema harms nothing


@pytest.fixture
def load(cluster: Cluster, cluster_schema: str, tmp_path) -> Iterator[Callable[[int], Load]]:
    """Starts the load and two reapers (harvester lanes as asked); stops all and heals the cluster."""
    topics = ClusterTopics(cluster.bootstrap)
    made: list[Load] = []

    def start(lanes: int, election: dict | None = None, standby: bool = True) -> Load:
        topic, item_topic = topics("data", PARTITIONS), topics("items", PARTITIONS)
        ack_topic, completion_topic = topics("acks", PARTITIONS), topics("done", 1)
        leader = topics("leader", lanes)
        cfg = make_config(
            cluster.dsn,
            cluster_schema,
            cluster.bootstrap,
            leader_topic=leader,
            harvester={"mark_batch": 500, "max_in_flight": 2000, **(election or {})},
        )
        env = {
            **env_for(cfg),
            "REAPER_HARVESTER__LANES": str(lanes),
            "REAPER_ACKER__ENABLED": "true",
            "REAPER_ACKER__TOPIC": ack_topic,
            "REAPER_ACKER__GROUP": f"acker-{uuid.uuid4().hex[:8]}",
            "REAPER_SWEEPER__ENABLED": "true",
            "REAPER_SWEEPER__INTERVAL": "2",
        }
        # the readers give a silent broker up after 2 s (librdkafka's default: 60 s), so what a
        # test measures is the reapers' wait, not the readers'
        data = Receiver(cluster.bootstrap, topic, PARTITIONS, conf=SHORT_WAIT)
        completions = Receiver(cluster.bootstrap, completion_topic, 1, conf=SHORT_WAIT)
        reapers = [ReaperProcess(env, tmp_path / "a.log")]
        assert reapers[0].wait_leader(90), "no reaper became leader"
        if standby:
            reapers.append(ReaperProcess(env, tmp_path / "b.log"))
            # the standby is past its start-up checks before any fault: a reaper that starts while no
            # primary accepts writes waits for one (database.startup_timeout), then exits (UNAVAILABLE)
            # for its supervisor to start again
            started = lambda: any(e.get("event") == "acker started" for e in reapers[1].events())  # noqa: E731
            assert wait_until(started, 90), reapers[1].log_path.read_text()[-2000:]
        gen = Generator(cluster.dsn, cluster_schema, topic, keys=30, per_txn=10).start(rate_per_s=400)
        fan = FanOuts(cluster.dsn, cluster_schema, item_topic, completion_topic).start(interval=0.5)
        consumers = Consumers(cluster.bootstrap, item_topic, ack_topic).start()
        got = Load(
            cluster,
            cluster_schema,
            topic,
            item_topic,
            gen,
            fan,
            consumers,
            data,
            completions,
            reapers,
            leader,
            cfg.harvester.leader_group,
            ack_topic,
            completion_topic,
        )
        made.append(got)
        return got

    try:
        yield start
    finally:
        for got in made:
            for stoppable in (got.gen, got.fan, got.consumers):
                try:
                    stoppable.stop()
                except BaseException:
                    pass
            stop_all(got.reapers)
            got.data.close()
            got.completions.close()
        try:
            cluster.up()  # every broker back, the old primary a standby again
        finally:
            topics.delete_all()


def _steady(load: Load, seconds: float) -> None:
    time.sleep(seconds)
    for r in load.reapers:
        assert r.proc.poll() is None, f"a reaper exited with {r.proc.returncode}: {r.log_path.read_text()[-3000:]}"


def test_kill_the_broker_leading_the_outbox_partitions(cluster, load):
    run = load(1)
    _steady(run, 4)
    leaders = cluster.topic_leaders(run.topic)
    victim = max(set(leaders.values()), key=list(leaders.values()).count)
    cluster.kill_broker(victim)
    _steady(run, 6)
    cluster.start_broker(victim)
    _steady(run, 3)
    run.check()


def test_kill_the_broker_leading_the_leader_topic(cluster, load):
    """The election's own broker dies: the leader topic's partition (heartbeats, the lease) and
    perhaps the election group's coordinator move; publishing resumes, with or without a fence."""
    run = load(1)
    _steady(run, 4)
    victim = cluster.topic_leaders(run.leader_topic)[0]
    cluster.kill_broker(victim)
    _steady(run, 6)
    cluster.start_broker(victim)
    _steady(run, 3)
    run.check()


def test_promote_the_standby_under_load_then_the_old_primary_rejoins(cluster, load):
    run = load(1)
    _steady(run, 3)
    old = cluster.primary()
    cluster.pg_kill(old)  # a crash: the promotion follows it
    cluster.promote()
    _steady(run, 5)
    cluster.rejoin()  # the old primary follows as the synchronous standby again
    _steady(run, 3)
    run.check()
    # every connection followed the promotion: the reapers stop cleanly, nothing left hanging
    for r in run.reapers:
        r.signal(signal.SIGTERM)
    codes = [r.wait(30) for r in run.reapers]
    assert codes == [0, 0], (codes, [r.log_path.read_text()[-2000:] for r in run.reapers])


def test_kill_the_active_controller_with_lanes(cluster, load):
    run = load(3)
    _steady(run, 4)
    victim = cluster.controller()
    cluster.kill_broker(victim)
    _steady(run, 6)
    cluster.start_broker(victim)
    _steady(run, 4)
    run.check()


def test_kill_the_active_controller_and_the_outbox_leader_at_once(cluster, load):
    """What losing a node that is broker and active controller in one does (a combined KRaft
    node, or a machine running both): the quorum elects a new controller first, which fences the
    dead broker only a session later, so the outbox partitions' leaders move late."""
    run = load(1)
    _steady(run, 4)
    leaders = cluster.topic_leaders(run.topic)
    broker = max(set(leaders.values()), key=list(leaders.values()).count)
    controller = cluster.controller()
    victims = [broker] if controller == broker else [broker, controller]  # one node in a combined layout
    for n in victims:
        cluster.kill_broker(n)
    _steady(run, 8)
    for n in victims:
        cluster.start_broker(n)
    _steady(run, 3)
    run.check()


def test_rolling_restart_of_all_three_brokers(cluster, load):
    run = load(1)
    _steady(run, 3)
    for n in (1, 2, 3):
        cluster.stop_broker(n)
        _steady(run, 1)
        cluster.start_broker(n)
        topics = [run.topic, run.item_topic]
        assert cluster.wait_in_sync(topics, 60), f"broker {n} did not catch up"
    _steady(run, 3)
    run.check()


def test_cut_one_broker_off_with_lanes(cluster, load):
    run = load(3)
    _steady(run, 4)
    leaders = cluster.topic_leaders(run.topic)
    victim = max(set(leaders.values()), key=list(leaders.values()).count)
    cluster.pause_broker(victim)  # alive but silent: no connection is refused, none answers
    _steady(run, 6)
    cluster.resume_broker(victim)
    _steady(run, 3)
    run.check()


def test_promote_the_standby_with_lanes(cluster, load):
    run = load(3)
    _steady(run, 4)
    cluster.promote()  # the primary is stopped (fenced) by the promotion itself
    _steady(run, 6)
    cluster.rejoin()
    _steady(run, 3)
    run.check()


def test_a_silent_broker_costs_the_reaper_at_most_a_session(cluster, load):
    """The broker leading an outbox partition stops answering (paused: connections stay open,
    nothing comes back). At the default election settings, every outbox partition publishes again,
    while it stays silent, within the group's session timeout after Kafka moved its leaderships
    (plus slack), not after librdkafka's 30-60 s request and socket timeouts."""
    defaults = config_mod.HarvesterConfig()
    election = {"heartbeat_timeout": defaults.heartbeat_timeout, "session_timeout": defaults.session_timeout}
    run = load(1, election, standby=False)  # the leader itself must recover: no standby takes over
    _steady(run, 4)
    victim = cluster.topic_leaders(run.topic)[0]
    cluster.pause_broker(victim)
    try:
        with psycopg.connect(cluster.dsn, autocommit=True, connect_timeout=10) as conn:
            # one record per partition (values as the ledger's: b"<key>:<seq>"), in the ledger too
            marks = {(f"silent-{p}".encode(), f"silent-{p}:0".encode(), p) for p in range(PARTITIONS)}
            for key, value, p in marks:
                conn.execute(
                    f'INSERT INTO "{run.schema}".outbox (topic, key, value, kafka_partition) VALUES (%s, %s, %s, %s)',
                    (run.topic, key, value, p),
                )
                run.gen.committed.add((key, value))
        values = {value for _, value, _ in marks}
        bound = BROKER_SESSION_S + defaults.session_timeout + 8.0
        assert wait_until(lambda: values <= set(run.data.values()), bound), (
            f"not every partition published within {bound} s of broker {victim} going silent",
            [r.log_path.read_text()[-3000:] for r in run.reapers],
        )
    finally:
        cluster.resume_broker(victim)
    _steady(run, 3)
    run.check()


def test_a_silent_broker_leading_the_acks_costs_the_acker_at_most_a_session(cluster, load):
    """The broker leading ack-topic partitions stops answering while acks flow. At the default
    election settings, the acks written to those partitions after it went silent are applied,
    while it stays silent, within the group's session timeout after Kafka moved its leaderships
    (plus slack), not after librdkafka's 60 s socket timeout; every batch completes exactly once."""
    defaults = config_mod.HarvesterConfig()
    election = {"heartbeat_timeout": defaults.heartbeat_timeout, "session_timeout": defaults.session_timeout}
    run = load(1, election, standby=False)  # one acker: it must recover itself, no other takes the partitions
    # batches tracked without messages: only the acks this test writes (after the pause) complete them
    with psycopg.connect(run.cluster.dsn, connect_timeout=10) as conn:
        batches: dict[int, str] = {}
        for n in range(30):
            batch = tracker.open_batch(
                conn, user_key=f"silent-acks-{n}", completion_topic=run.completion_topic, schema=run.schema
            )
            runs = [
                format_run(g.batch_id, g.group_id, g.start, g.upto - 1)
                for g in tracker.add_items(conn, batch, 8, schema=run.schema)
            ]
            tracker.close_batch(conn, batch, schema=run.schema)
            batches[batch.id] = ",".join(runs)
        conn.commit()
    run.fan.committed |= set(batches)  # in the ledger: each completes exactly once
    _steady(run, 4)
    leaders = cluster.topic_leaders(run.ack_topic)
    victim = max(set(leaders.values()), key=list(leaders.values()).count)
    silent = {p for p, b in leaders.items() if b == victim}
    written: dict[int, int] = {}  # batch -> the ack partition its acks went to
    # the acks' writer gives a silent broker up after 2 s: what is measured is the acker's wait
    acks = Producer(
        {
            **QUIET,
            "bootstrap.servers": cluster.bootstrap,
            "enable.idempotence": True,
            **SHORT_WAIT,
            "request.timeout.ms": 2000,
        }
    )
    paused_at = cluster.pause_broker(victim)
    assert paused_at is not None, f"broker {victim} was not running"
    try:
        for batch_id, value in batches.items():
            acks.produce(
                run.ack_topic,
                key=str(batch_id).encode(),
                value=value.encode(),
                on_delivery=lambda err, msg: err is None and written.__setitem__(int(msg.key()), msg.partition()),
            )
        assert acks.flush(60) == 0 and len(written) == len(batches), "the acks were not written"
        assert silent & set(written.values()), f"no ack went to a partition of broker {victim}: {written}"

        def applied() -> bool:
            with psycopg.connect(run.cluster.dsn, autocommit=True, connect_timeout=10) as conn:
                rows = conn.execute(
                    f'SELECT count(*) FROM "{run.schema}".batch WHERE id = ANY(%s) AND state = %s',
                    (list(batches), "complete"),
                ).fetchone()
            return rows is not None and rows[0] == len(batches)

        bound = BROKER_SESSION_S + defaults.session_timeout + 8.0
        if not wait_until(applied, bound, step=0.2):
            late = wait_until(applied, 120, step=0.2)
            waited = time.monotonic() - paused_at
            pytest.fail(
                f"the acks on broker {victim}'s partitions {sorted(silent)} were not applied within {bound} s of it "
                f"going silent ({'applied after' if late else 'still not applied after'} {waited:.1f} s)\n"
                + run.reapers[0].log_path.read_text()[-3000:]
            )
        print(f"acks on the silent broker's partitions applied {time.monotonic() - paused_at:.1f} s after the pause")
    finally:
        cluster.resume_broker(victim)
    _steady(run, 3)
    run.check()
