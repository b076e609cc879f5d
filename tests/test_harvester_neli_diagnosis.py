"""When the election is not getting anywhere (harvester.election.diagnosis): a unit fenced for long
reports why it does not resume, a heartbeat producer that gets nothing back for as long is replaced,
and an election thread blocked somewhere is reported with its stack. Before, a fence that never
ended left nothing after "neli fenced"."""

from __future__ import annotations

import threading
import time
import uuid

from confluent_kafka import Producer
from support.faults import HeldHeartbeats
from support.harness import heartbeats_flowing, wait_until
from support.json_log import events, json_log
from support.tcp_proxy import KafkaProxy

from harvester.election.diagnosis import FencedReports, Watchdog, why_not_resuming
from harvester.election.neli import FENCED, LEADER, Neli
from harvester.metrics import get as get_metrics

SESSION = 3.0  # the reports come after 3 session timeouts: 9 s


def _neli(bootstrap: str, topic: str, **kw) -> Neli:
    return Neli(
        bootstrap=bootstrap,
        client={},
        consumer={},
        topic=topic,
        group=f"g-{uuid.uuid4().hex[:8]}",
        min_poll_interval=0.1,
        heartbeat_timeout=1.0,
        session_timeout=SESSION,
        metrics=get_metrics(),
        **kw,
    )


def _logged(out, event: str) -> list[dict]:
    return [e for e in events(out) if e.get("event") == event]


def test_a_unit_fenced_for_long_says_its_heartbeats_go_unanswered_and_why(kafka_bootstrap, topics):
    """Only the heartbeat producer's path is cut (the leader consumer stays in the group, so the
    partition stays held): the fence lasts, and the report names the missing acknowledgements, the
    heartbeats still held by the producer and the delivery error they ended with."""
    proxy = KafkaProxy(kafka_bootstrap)
    with json_log() as out:
        n = _neli(kafka_bootstrap, topics("leader"), producer={"bootstrap.servers": proxy.address}).start()
        try:
            assert wait_until(lambda: n.state == LEADER, 30)
            time.sleep(1)
            assert heartbeats_flowing(n)  # through the proxy
            proxy.swallow()
            assert wait_until(lambda: n.state == FENCED, 5)
            assert wait_until(lambda: _logged(out, "still fenced: not resuming"), 3 * SESSION + 10), (
                "a unit fenced for three session timeouts was never reported"
            )
            report = _logged(out, "still fenced: not resuming")[0]
            assert report["why"] == "no heartbeat acknowledged recently", report
            assert report["in_group"] is True and report["unit"] == 0
            assert report["fenced_s"] >= 3 * SESSION and report["heartbeat_age_s"] >= 3 * SESSION
            assert report["heartbeats_unanswered"] > 0 and report["heartbeats_back"] == 0
            assert report["last_round_trip_s"] is not None, "the round trip of the last heartbeat back, before the cut"
            assert report["heartbeat_errors"] > 0 and "timed out" in report["last_heartbeat_error"], report
            proxy.heal()
            assert wait_until(lambda: n.leader_id() is not None, 30), "heartbeats came back: never resumed"
        finally:
            n.stop()
            proxy.close()


class _FirstThroughProxy:
    """A heartbeat producer factory whose first producer goes through `proxy` (swallowed: a client
    that never gets an answer again) and every later one straight to the broker."""

    def __init__(self, proxy: KafkaProxy) -> None:
        self.proxy, self.made = proxy, 0

    def __call__(self, conf: dict) -> Producer:
        self.made += 1
        return Producer({**conf, "bootstrap.servers": self.proxy.address} if self.made == 1 else conf)


def test_a_heartbeat_producer_that_gets_nothing_back_for_long_is_replaced_and_the_unit_resumes(kafka_bootstrap, topics):
    """The heartbeat producer is the election's one client that is never replaced otherwise: one
    that gets no answer again (the consumer in the group, the broker up) left a lone leader fenced
    for good after a broker restart under load. Replaced, the unit resumes; before, it never did."""
    proxy = KafkaProxy(kafka_bootstrap)
    factory = _FirstThroughProxy(proxy)
    with json_log() as out:
        n = _neli(kafka_bootstrap, topics("leader"), producer={}, make_producer=factory).start()
        try:
            assert wait_until(lambda: n.state == LEADER, 30)
            time.sleep(1)
            first = n.leader_id()
            proxy.swallow()  # for good: only a new producer gets its heartbeats through
            assert wait_until(lambda: n.state == FENCED, 5)
            assert wait_until(lambda: n.leader_id() is not None, 3 * SESSION + 15), (
                "a heartbeat producer that never gets an answer again kept the unit fenced"
            )
            assert factory.made == 2 and n.leader_id() != first
            logged = [e["event"] for e in events(out)]
            report, replaced = (
                "still fenced: not resuming",
                "heartbeat producer got nothing back for long: replacing it",
            )
            assert report in logged and replaced in logged and logged.index(report) < logged.index(replaced)
        finally:
            n.stop()
            proxy.close()


def test_a_producer_that_sent_nothing_is_kept_while_the_unit_stays_fenced(kafka_bootstrap, topics):
    """Heartbeats held back before they reach the producer (nothing sent, nothing unanswered): the
    long fence is reported, but the producer is not what keeps it fenced and is kept."""
    held = HeldHeartbeats()
    with json_log() as out:
        n = _neli(kafka_bootstrap, topics("leader"), producer={}, make_producer=held).start()
        try:
            assert wait_until(lambda: n.state == LEADER, 30)
            made = n._producer
            held.hold(3 * SESSION + 8)
            assert wait_until(lambda: _logged(out, "still fenced: not resuming"), 3 * SESSION + 10)
            assert n._producer is made and not _logged(
                out, "heartbeat producer got nothing back for long: replacing it"
            )
        finally:
            n.stop()


def test_an_election_thread_blocked_in_a_callback_is_reported_with_its_stack(kafka_bootstrap, topics):
    held, release = HeldHeartbeats(), threading.Event()

    def blocking_on_fence(state: str, _leader_id) -> None:
        if state == FENCED:
            release.wait(60)

    with json_log() as out:
        n = _neli(kafka_bootstrap, topics("leader"), producer={}, make_producer=held, on_change=blocking_on_fence)
        n.start()
        try:
            assert wait_until(lambda: n.state == LEADER, 30)
            held.hold(3 * SESSION + 5)
            assert wait_until(lambda: n.state == FENCED, 5)
            assert wait_until(
                lambda: _logged(out, "the election thread has not pulsed for long: blocked"), 3 * SESSION + 10
            )
            report = _logged(out, "the election thread has not pulsed for long: blocked")[0]
            assert "blocking_on_fence" in report["stack"] and "_beat" in report["stack"], report["stack"]
            assert report["silent_s"] > 3 * SESSION
            release.set()
            held.hold(0)
            assert wait_until(lambda: n.leader_id() is not None, 30), "released: never resumed"
        finally:
            release.set()
            n.stop()


def test_reasons_in_the_order_a_resumption_checks_them():
    def why(**kw):
        args = dict(heartbeat_age=0.1, fresh=0.75, grace_left=0.0, in_group=True, steady=2.0, needed=1.0)
        return why_not_resuming(**{**args, **kw})

    assert why(in_group=False, heartbeat_age=9.0) == "the leader consumer has no group member id"
    assert why(heartbeat_age=0.8, grace_left=1.0) == "no heartbeat acknowledged recently"
    assert why(grace_left=0.5, steady=0.0) == "waiting out the grace after a stall of this process"
    assert why(steady=0.5) == "heartbeats back, not yet steady for long enough"
    assert why() == "ready to resume at the next pulse"


def test_a_long_fence_is_reported_after_the_interval_and_again_every_interval_each_fence_anew():
    reports = FencedReports(units=2, every=9.0)
    assert not reports.due(0, fenced_at=100.0, now=108.9)
    assert reports.due(0, fenced_at=100.0, now=109.0)
    assert not reports.due(0, fenced_at=100.0, now=117.9)
    assert reports.due(0, fenced_at=100.0, now=118.0)
    assert not reports.due(1, fenced_at=100.0, now=108.0), "units are counted apart"
    assert not reports.due(0, fenced_at=130.0, now=135.0), "a new fence starts its own count"
    assert reports.due(0, fenced_at=130.0, now=139.0)


def test_the_watchdog_says_nothing_of_a_paused_process_or_a_wait_for_the_database():
    stop, on_purpose = threading.Event(), [False]
    last_pulse = [0.0]
    dog = Watchdog(threading.current_thread(), lambda: last_pulse[0], lambda: on_purpose[0], 9.0, stop)
    assert dog.check(now=10.0, woke_late_by=0.0, reported_at=0.0)
    assert not dog.check(now=8.0, woke_late_by=0.0, reported_at=0.0), "pulsed within the interval"
    assert not dog.check(now=10.0, woke_late_by=9.5, reported_at=0.0), "the watchdog itself was paused as long"
    assert not dog.check(now=15.0, woke_late_by=0.0, reported_at=10.0), "reported less than an interval ago"
    on_purpose[0] = True
    assert not dog.check(now=30.0, woke_late_by=0.0, reported_at=0.0), "a step-down waits for its database"


def test_a_leader_consumer_kept_out_of_its_group_says_what_the_broker_answered(kafka_bootstrap, topics):
    """A session timeout the brokers refuse (start-up refuses it: harvester.election.group_bounds;
    here that check is passed by) keeps the consumer out of the group: each replacement names why."""
    from confluent_kafka.admin import AdminClient

    from harvester.election.group_bounds import broker_session_bounds

    low = max(lo for lo, _ in broker_session_bounds(AdminClient({"bootstrap.servers": kafka_bootstrap}), 10.0).values())
    seconds = (low - 100) / 1000
    n = Neli(
        bootstrap=kafka_bootstrap,
        client={},
        consumer={},
        producer={},
        topic=topics("leader"),
        group=f"g-{uuid.uuid4().hex[:8]}",
        min_poll_interval=0.1,
        heartbeat_timeout=seconds / 2,
        session_timeout=seconds,
        metrics=get_metrics(),
    )
    n.cluster_id = "checked elsewhere"  # prepare() would refuse this session timeout
    with json_log() as out:
        n.start()
        try:
            assert wait_until(lambda: _logged(out, "leader consumer out of the group for long: replacing it"), 30)
            warning = _logged(out, "leader consumer out of the group for long: replacing it")[0]
            assert "session timeout" in (warning["last_error"] or "").lower(), warning
        finally:
            n.stop()


def test_an_election_thread_that_fails_stops_the_harvester_instead_of_never_leading_again(
    pg_dsn, kafka_bootstrap, schema, topics
):
    """A leadership callback that raises something other than a KafkaException ended the election
    thread, every unit a follower for good, while the process stayed up and ready."""
    from support.harness import make_config

    from harvester.units import Harvester

    h = Harvester(make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader")))
    unit = h.units[0]

    def broken(state, leader_id):
        raise RuntimeError("a bug in a leadership callback")

    unit._on_neli = broken  # what the lease calls on every change, from the election thread
    with json_log() as out:
        h.start()
        try:
            assert wait_until(lambda: h.error is not None, 30), "the election thread died and nothing noticed"
            assert "a bug in a leadership callback" in str(h.error)
            assert not unit.leading
            assert _logged(out, "election thread failed: no unit will lead")
        finally:
            h.stop(2)
