"""Harvest units under faults, with reaper subprocesses: SIGKILL and SIGSTOP of a reaper leading some
units, units moving between reapers, and the lane count changed live (drain, then switch)."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from support.harness import Generator, Receiver, check_published, env_for, make_config, order_violations, wait_until
from support.reaper import ReaperProcess, stop_all
from support.teardown import drop_schema

PARTITIONS = 3
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("reaper-failover")]


def units_led(p: ReaperProcess) -> set[int]:
    """Units whose last NELI state in p's log is leader."""
    state: dict[int, str] = {}
    for e in p.events():
        if e.get("event", "").startswith("neli ") and "leader_partition" in e:
            state[e["leader_partition"]] = e["event"][5:]
    return {u for u, s in state.items() if s == "leader"}


def _one_leading(procs: list[ReaperProcess]) -> ReaperProcess:
    """The first of `procs` that leads some unit, waited for (up to 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for proc in procs:
            if units_led(proc):
                return proc
        time.sleep(0.1)
    raise AssertionError("none of them leads a unit")


def _env(pg_dsn, schema, bootstrap, leader, lanes):
    cfg = make_config(
        pg_dsn, schema, bootstrap, leader_topic=leader, harvester={"mark_batch": 500, "max_in_flight": 2000}
    )
    return {**env_for(cfg), "REAPER_HARVESTER__LANES": str(lanes)}


def test_sigkill_and_sigstop_of_reapers_leading_some_units(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    topic, leader = topics("data", partitions=PARTITIONS), topics("leader", partitions=3)
    env = _env(pg_dsn, schema, kafka_bootstrap, leader, lanes=3)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(pg_dsn, schema, topic, keys=40, per_txn=10).start(rate_per_s=800)
    procs: list[ReaperProcess] = []
    try:
        a = ReaperProcess(env, tmp_path / "a.log")
        procs.append(a)
        assert wait_until(lambda: units_led(a) == {0, 1, 2}, 60), units_led(a)
        b = ReaperProcess(env, tmp_path / "b.log")
        procs.append(b)
        # a unit moves to the newcomer (cooperative-sticky spreads them) while rows flow
        assert wait_until(lambda: units_led(b) and len(units_led(a)) + len(units_led(b)) == 3, 60), (
            units_led(a),
            units_led(b),
        )
        c = ReaperProcess(env, tmp_path / "c.log")
        procs.append(c)
        assert wait_until(lambda: units_led(c), 60), "the third reaper got no unit"
        # With the tests' 1 s heartbeat timeout a loaded machine fences leaders now and then, and a
        # fenced reaper can be left with no unit for a while: the victims are reapers that lead some.
        time.sleep(1)
        victim = _one_leading([a, b, c])
        killed = units_led(victim)
        victim.signal(signal.SIGKILL)  # its units move to the other two after the session timeout
        rest = [p for p in (a, b, c) if p is not victim]
        assert wait_until(lambda: units_led(rest[0]) | units_led(rest[1]) == {0, 1, 2}, 30), [
            units_led(p) for p in rest
        ]
        time.sleep(1)
        paused = _one_leading(rest)
        last = rest[1] if paused is rest[0] else rest[0]
        stopped = units_led(paused)
        paused.signal(signal.SIGSTOP)  # longer than the session: the last one takes its units over
        assert wait_until(lambda: units_led(last) == {0, 1, 2}, 30), units_led(last)
        time.sleep(1)
        paused.signal(signal.SIGCONT)  # it finds itself fenced and revoked, and may get units again
        time.sleep(4)
        gen.stop()
        check_published(receiver, gen)
        print(f"the killed reaper led {sorted(killed)}, the stopped one {sorted(stopped)}")
    finally:
        gen.stop()
        stop_all(procs)
        receiver.close()


@dataclass
class LaneChange:
    """Rows flowing from a generator, and one reaper harvesting them in 1 lane on its own leader
    topic `one` (`old`, leading); `two` is a leader topic for the 2-lane configuration that follows."""

    receiver: Receiver
    gen: Generator
    old: ReaperProcess
    one: str
    two: str
    procs: list[ReaperProcess]

    def start_new(self, pg_dsn, schema, bootstrap, tmp_path) -> list[ReaperProcess]:
        """Two reapers of one 2-lane configuration (one group for both)."""
        env_new = _env(pg_dsn, schema, bootstrap, self.two, lanes=2)
        new = [ReaperProcess(env_new, tmp_path / f"new{i}.log") for i in range(2)]
        self.procs += new
        return new


@contextlib.contextmanager
def lane_change(pg_dsn, kafka_bootstrap, schema, topics, tmp_path) -> Iterator[LaneChange]:
    topic = topics("data", partitions=PARTITIONS)
    one, two = topics("leader", partitions=1), topics("leader", partitions=2)
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    gen = Generator(pg_dsn, schema, topic, keys=40, per_txn=10).start(rate_per_s=800)
    procs: list[ReaperProcess] = []
    try:
        old = ReaperProcess(_env(pg_dsn, schema, kafka_bootstrap, one, lanes=1), tmp_path / "old.log")
        procs.append(old)
        assert wait_until(lambda: units_led(old) == {0}, 60)
        yield LaneChange(receiver, gen, old, one, two, procs)
    finally:
        gen.stop()
        stop_all(procs)
        receiver.close()


def test_lanes_changed_live_by_draining_then_switching(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    with lane_change(pg_dsn, kafka_bootstrap, schema, topics, tmp_path) as run:
        # The new lane count on the OLD leader topic is refused: it would overlap the old units.
        wrong = ReaperProcess(_env(pg_dsn, schema, kafka_bootstrap, run.one, lanes=2), tmp_path / "wrong.log")
        assert wrong.wait(60) == 2
        assert any("harvest unit(s) are configured" in (e.get("error") or "") for e in wrong.events())
        time.sleep(2)
        # Drain: the old generation stops (SIGTERM settles what is in flight) ...
        assert run.old.terminate(60) == 0
        # ... then switch: the new generation, on its own leader topic, marks from the head.
        new = run.start_new(pg_dsn, schema, kafka_bootstrap, tmp_path)
        assert wait_until(lambda: units_led(new[0]) | units_led(new[1]) == {0, 1}, 60)
        time.sleep(3)
        run.gen.stop()
        check_published(run.receiver, run.gen)


def test_lanes_changed_live_without_draining_are_held_apart_by_the_claim(
    pg_dsn, kafka_bootstrap, schema, topics, tmp_path
):
    """The operator skips the drain: the new lane count starts while the old reaper still harvests.
    The database's claim (harvester.publishing.ownership) keeps the new layout from marking until the old one has
    stopped and its hold ran out, so no key is harvested by two units at once, and none regresses."""
    with lane_change(pg_dsn, kafka_bootstrap, schema, topics, tmp_path) as run:
        receiver, gen = run.receiver, run.gen
        new = run.start_new(pg_dsn, schema, kafka_bootstrap, tmp_path)

        def refused(p: ReaperProcess) -> bool:
            return any(
                e.get("event", "").startswith("not marking") and "lanes=1" in (e.get("error") or "") for e in p.events()
            )

        # one unit each (one configuration: one group), both refused by the old layout's hold
        assert wait_until(lambda: units_led(new[0]) and units_led(new[1]), 60), (units_led(new[0]), units_led(new[1]))
        assert wait_until(lambda: refused(new[0]) and refused(new[1]), 20), "the new layout was not refused"
        time.sleep(3)  # both layouts up, rows flowing: only the old one marks
        assert run.old.terminate(60) == 0
        stopped = time.monotonic()
        # The new layout takes the table once the old hold ran out (heartbeat_timeout + 1 s).
        # (gen.committed is read under the GIL as a whole set copy: rows committed after this are
        # checked by check_published below)
        assert receiver.wait_for(set(gen.committed), 60), "the new layout did not take the table over"
        print(f"the new layout published everything {time.monotonic() - stopped:.1f} s after the old stopped")
        time.sleep(2)
        gen.stop()
        check_published(receiver, gen)
        # Two layouts marking at once would each take the other's rows from the head, over and
        # over: every row published several times. Held apart, only the rows in flight at the
        # handover can be published twice.
        duplicates = len(receiver.records) - len(receiver.unique())
        print(f"{duplicates} duplicates of {len(receiver.unique())} records")
        assert duplicates <= 2000, duplicates  # max_in_flight


def test_reordered_outboxes_in_one_group_are_held_apart_by_the_claim(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    """harvester.outboxes reordered without a drain: same names, lanes, group and topic, so the new
    reaper joins the old one's group, and partition 0 now means the other table. The first unit's
    partition is part of the layout, so each table is marked under one ordering only."""
    import json
    import uuid

    import psycopg

    from tracker import schema as schema_mod

    other = f"s_{uuid.uuid4().hex[:10]}"
    schema_mod.migrate(pg_dsn, other)
    data = [topics("data", partitions=PARTITIONS) for _ in range(2)]  # one per table: keys overlap
    leader = topics("leader", partitions=2)
    base = env_for(
        make_config(
            pg_dsn, schema, kafka_bootstrap, leader_topic=leader, harvester={"mark_batch": 500, "max_in_flight": 2000}
        )
    )
    orders, billing = {"name": "orders", "schema": schema}, {"name": "billing", "schema": other}
    receivers = [Receiver(kafka_bootstrap, topic, PARTITIONS) for topic in data]
    gens = [
        Generator(pg_dsn, s, topic, keys=40, per_txn=10).start(rate_per_s=400)
        for s, topic in zip((schema, other), data)
    ]
    procs: list[ReaperProcess] = []
    try:
        old = ReaperProcess({**base, "REAPER_HARVESTER__OUTBOXES": json.dumps([orders, billing])}, tmp_path / "old.log")
        procs.append(old)
        assert wait_until(lambda: units_led(old) == {0, 1}, 60)
        new = ReaperProcess({**base, "REAPER_HARVESTER__OUTBOXES": json.dumps([billing, orders])}, tmp_path / "new.log")
        procs.append(new)
        assert wait_until(lambda: units_led(new), 60), "the group gave the newcomer no unit"
        assert wait_until(
            lambda: any(e.get("event", "").startswith("not marking") for p in (old, new) for e in p.events()), 20
        ), "neither ordering was refused"
        time.sleep(3)
        assert old.terminate(60) == 0
        time.sleep(3)
        for g in gens:
            g.stop()
        for receiver, g in zip(receivers, gens):
            check_published(receiver, g)
            duplicates = len(receiver.records) - len(receiver.unique())
            print(f"{duplicates} duplicates of {len(receiver.unique())} records")
            assert duplicates <= 2000, duplicates  # what one unit can have in flight at the handover
    finally:
        for g in gens:
            g.stop()
        stop_all(procs)
        for receiver in receivers:
            receiver.close()
        drop_schema(pg_dsn, other, if_exists=False)
