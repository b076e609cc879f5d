"""Leader election, Fast NELI style, one lease per partition of the leader topic (one per harvest unit).

Every reaper subscribes one consumer, in one group, to the leader topic; the member holding
partition u leads unit u (harvester.units). Each lease below is independent: its own heartbeat,
fence, leader id and state; one consumer and one producer serve them all, and they never touch a
database, so one unit's stall cannot hold up another's leadership. The leader of a unit produces a
heartbeat to its partition at most every
`min_poll_interval`; the broker's acknowledgement of one (or reading it back, whichever comes
first) vouches for the time it was sent. It fences itself (stops publishing) when none sent within
`heartbeat_timeout` has reached the broker, which is shorter than the group's session timeout, so a
leader cut off from Kafka stops before the group can hand partition 0 to another member. It
resumes if heartbeats return, steadily for `resume_steady` (harvester.election.resumption), while
it still holds the partition. Each acquisition (and each resumption) gets a fresh random leader id.

After a stall of this process itself (SIGSTOP, a VM pause: the election loop did not run for longer
than `heartbeat_timeout`), the group may have handed the partition on meanwhile, and the process is
the last to know: its own heartbeats come back before librdkafka reports the lost session. So a
resumption waits RESUME_GRACE after such a stall, time for the consumer's next group heartbeat to
learn of a lost session (on_lost) first. A fence caused by Kafka being away (the loop kept running)
resumes once heartbeats have come back steadily.

`leader_id()` is computed from the clock when asked, not from the last state the polling thread
saw: a process that was paused (SIGSTOP, a long GC-like stall) sees itself fenced at once.
Cooperative-sticky assignment keeps partition 0 with its holder when other members join.

The heartbeats themselves (sent, vouched for, judged, and their producer replaced when it hears
nothing back) are harvester.election.heartbeats'; this module is the group's side: the leader
consumer, its assignments and revocations, the election thread and stepping down.

A leader whose database work goes unanswered for `harvester.step_down_after` on every unit it
leads fences, leaves the group and joins again once its database answers
(harvester.election.step_down): Kafka alone would leave it the partitions through a cut from Postgres.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from functools import partial

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from harvester import logs
from harvester.election.clients import heartbeat_producer_conf, leader_consumer_conf
from harvester.election.diagnosis import REPORT_SESSIONS, FencedReports, Watchdog
from harvester.election.group_bounds import check_session_timeout
from harvester.election.heartbeats import Heartbeats
from harvester.election.leader_topic import ensure_leader_topic
from harvester.election.lease import (  # noqa: F401  (FENCED, LEADER: importers use them from here)
    FENCED,
    FOLLOWER,
    LEADER,
    Lease,
)
from harvester.election.resumption import Resumption
from harvester.election.step_down import StepDown, other_members
from harvester.election.timeouts import election_client_defaults
from harvester.metrics import MetricsLike
from harvester.publishing.ports import ProducerFactory, ProducerLike

RESUME_STEADY = 1.0  # seconds of steady heartbeats before a fenced lease resumes (harvester.resume_steady)
RESUME_GRACE = 1.0  # seconds: several group heartbeats (heartbeat.interval.ms is at most 250 ms)
# A revocation waits this long at most (and at most a quarter of heartbeat_timeout, so the other
# units' heartbeats are not held up) for marks on their way to finish: see Lease.marking.
REVOKE_MARK_WAIT = 1.0
# A leader consumer without a group member id for this many session timeouts is replaced by a new
# one (see Neli._check_membership).
OUT_OF_GROUP_SESSIONS = 2


class Neli(Heartbeats):
    def __init__(
        self,
        *,
        bootstrap: str,
        client: dict,
        consumer: dict,
        producer: dict,
        topic: str,
        group: str,
        min_poll_interval: float,
        heartbeat_timeout: float,
        session_timeout: float,
        metrics: MetricsLike | Callable[[int], MetricsLike],
        on_change: Callable[[str, uuid.UUID | None], None] = lambda s, lid: None,
        units: int = 1,
        make_producer: ProducerFactory = Producer,
        resume_steady: float = RESUME_STEADY,
        step_down: StepDown | None = None,
    ) -> None:
        """`metrics`: one set for all units, or a function giving unit u's. `on_change` is unit
        0's callback; set `lease(u).on_change` for the others. `make_producer` makes the heartbeat
        producer from its configuration (harvester.publishing.ports.Providers.heartbeat_producer).
        `resume_steady`: see harvester.election.resumption. `step_down`: when to leave the group
        while the database is out of reach (harvester.election.step_down); None: never."""
        self.topic, self.min_poll, self.hb_timeout = topic, min_poll_interval, heartbeat_timeout
        self.session_timeout = session_timeout
        self._log = logs.get("reaper.neli")
        self.instance = uuid.uuid4().hex.encode()  # tags this process's heartbeats
        unit_metrics = metrics if callable(metrics) else (lambda u: metrics)
        self._m = unit_metrics(0)
        self.leases = [
            Lease(u, heartbeat_timeout, unit_metrics(u), on_change if u == 0 else (lambda s, lid: None))
            for u in range(units)
        ]
        # a fence within one session timeout of the resumption before it counts as a flap
        self._resumptions = [Resumption(resume_steady, session_timeout, heartbeat_timeout) for _ in range(units)]
        # a fence or a silent election thread that lasts is reported with why (harvester.election.diagnosis)
        self._reports = FencedReports(units, REPORT_SESSIONS * session_timeout)
        self._waiting_on_purpose = False  # a step-down waits for its database in the election thread
        base = {"bootstrap.servers": bootstrap, **client}
        # timeouts on a silent broker (harvester.election.timeouts): kafka.client and the
        # consumer/producer sections still override them
        waits = {
            "bootstrap.servers": bootstrap,
            **election_client_defaults(heartbeat_timeout, session_timeout),
            **client,
        }
        self._admin_conf = {**base, "logger": logs.KafkaLogger("leader-admin")}
        self._group = group
        self._admin: AdminClient | None = None  # made by prepare(), or by a step-down asking who else is in the group
        self.cluster_id: str | None = None  # the Kafka cluster's id, once prepare() read it
        self._consumer_conf = leader_consumer_conf(waits, consumer, group, session_timeout)
        self._producer_conf = heartbeat_producer_conf(waits, producer, session_timeout)
        self._last_pulse = time.monotonic()
        self._in_group_at = time.monotonic()  # last time the consumer had a group member id
        self._group_error: str | None = None  # the leader consumer's last error since then
        self.error: BaseException | None = None  # what ended the election thread, if not a stop
        self._resume_after = 0.0  # monotonic: no resumption before this (see RESUME_GRACE)
        self._stop = threading.Event()
        self._closed = threading.Event()
        self._consumer: Consumer | None = None
        self._make_producer = make_producer
        self._step_down = step_down
        self._producer: ProducerLike | None = None
        self._producer_made = 0.0  # monotonic: when the heartbeat producer in use was made
        self._back_at = 0.0  # monotonic: when a heartbeat of any unit last came back
        self._thread = threading.Thread(target=self._run, name="reaper-neli", daemon=True)
        self.watchdog = Watchdog(
            self._thread,
            lambda: self._last_pulse,
            lambda: self._waiting_on_purpose,
            REPORT_SESSIONS * session_timeout,
            self._stop,
        )

    # ------------------------------------------------------------------ public

    def prepare(self) -> str:
        """Make sure the leader topic is there (and agrees with the units) before anything starts;
        return the Kafka cluster's id. Done once; start() does it if nobody did."""
        if self.cluster_id is None:
            admin = self._admin_client()
            try:
                self.cluster_id = ensure_leader_topic(admin, self.topic, partitions=len(self.leases))
                # a session timeout the brokers refuse would keep the leader consumer out of its group for good
                check_session_timeout(admin, int(self._consumer_conf["session.timeout.ms"]))
            finally:
                admin.poll(0)  # an admin client's log lines wait for a poll: hand them to its logger
        return self.cluster_id

    def _admin_client(self) -> AdminClient:
        """The election's one admin client: the start-up checks', then a step-down's."""
        if self._admin is None:
            self._admin = AdminClient(self._admin_conf)
        return self._admin

    def start(self) -> Neli:
        self.prepare()
        self._producer = self._make_producer(self._producer_conf)
        self._producer_made = time.monotonic()
        # Connect to the leader topic's broker now rather than at a leadership's first heartbeat,
        # whose connection set-up (several round trips to a busy broker) would eat into the grace a
        # new leadership gets. The value is no heartbeat (see _sent_at): every reaper ignores it.
        try:
            self._producer.produce(self.topic, value=self.instance + b":connect", partition=0)
        except BufferError:
            pass
        self._consumer = self._new_consumer()
        self._thread.start()
        self.watchdog.start()
        return self

    def _new_consumer(self) -> Consumer:
        consumer = Consumer(self._consumer_conf)
        consumer.subscribe([self.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost)
        return consumer

    def lease(self, unit: int) -> Lease:
        return self.leases[unit]

    # Unit 0's lease, for one-unit deployments and tests.
    @property
    def state(self) -> str:
        return self.leases[0].state

    @property
    def heartbeat_back_at(self) -> float:
        """time.monotonic() when a heartbeat of any unit last came back from the leader topic (0.0:
        none yet): whether heartbeats flow, for health checks and tests."""
        return self._back_at

    def leader_id(self) -> uuid.UUID | None:
        return self.leases[0].leader_id()

    def valid_until(self) -> float:
        return self.leases[0].valid_until()

    def stop(self, timeout: float = 10.0) -> None:
        """Leave the group (the partitions move to a standby at once) and stop."""
        self._stop.set()
        if self._thread.ident is None:
            return  # never started
        self._thread.join(timeout)

    # ------------------------------------------------------------------ internals

    def _mine(self, partitions: list[TopicPartition]) -> list[Lease]:
        return [self.leases[p.partition] for p in partitions if 0 <= p.partition < len(self.leases)]

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        consumer.incremental_assign([TopicPartition(p.topic, p.partition, OFFSET_END) for p in partitions])
        if consumer is not self._consumer:
            return  # a replaced consumer (closing) never leads
        for lease in self._mine(partitions):
            if not lease.holding:
                lease.holding = True
                self._resumptions[lease.unit].acquired()
                lease.acquire()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition], lost: bool = False) -> None:
        # A replaced consumer (see _check_membership) held nothing.
        revoked = [lease for lease in self._mine(partitions) if lease.holding] if consumer is self._consumer else []
        for lease in revoked:
            lease.holding = False
            lease._m.revocations.inc()
            lease.set(FOLLOWER, None)
        # Let the marks on their way return before giving the partitions up (the group hands them
        # on once this callback returns): all units within one bound first, since the other units'
        # heartbeats wait for this thread too; then a mark still out is waited for until its
        # deadline (Lease.end_marks_or_deadline). Order first: the other units' heartbeats wait (at
        # worst they fence and resume, which costs duplicates, never order).
        deadline = time.monotonic() + min(REVOKE_MARK_WAIT, self.hb_timeout / 4)
        for lease in revoked:
            if lost:  # the group has handed the partition on already: nothing to hold back
                if not lease.end_marks(max(0.0, deadline - time.monotonic())):
                    self._log.warning("partition lost with a mark still on its way", unit=lease.unit)
                continue
            lease.end_marks_or_deadline(
                deadline,
                partial(
                    self._log.warning, "revoked with a mark still on its way: waiting out its deadline", unit=lease.unit
                ),
            )
        try:
            consumer.incremental_unassign(partitions)
        except KafkaException:
            pass

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._on_revoke(consumer, partitions, lost=True)

    def _pulse(self) -> None:
        consumer, producer = self._consumer, self._producer
        assert consumer is not None and producer is not None  # start() made both before this thread ran
        messages = consumer.consume(64, self.min_poll / 2)
        # Checked after consume(), where this thread spends nearly all its time (and so where a
        # SIGSTOP or a VM pause lands): the time since the previous pulse ended includes the stall.
        returned = time.monotonic()
        if returned - self._last_pulse > self.hb_timeout:
            self._resume_after = returned + RESUME_GRACE
            self._in_group_at += returned - self._last_pulse  # our own stall is no sign of a stuck consumer
            self._log.warning(
                "this process stalled: no resumption for a while", stalled_s=round(returned - self._last_pulse, 3)
            )
        for msg in messages:
            error = msg.error()
            if error is None:
                self._vouch(msg.partition(), msg.value())
            elif error.code() != KafkaError._PARTITION_EOF:
                self._group_error = error.str()  # e.g. a JoinGroup the broker refused: said when out of the group
        producer.poll(0)  # the broker's acknowledgements of heartbeats (_acked), before they are judged
        now = time.monotonic()
        for lease in self.leases:
            if lease.holding:
                self._beat(lease, now)
        self._check_membership(now)
        if (
            self._step_down is not None
            and (cut_off := self._step_down.due(self.leases, now))
            and self._step_down.anyone_to_hand_over_to(now, lambda: self._others(consumer))
        ):
            # Closing the consumer leaves the group (nothing is held by then: _on_revoke only unassigns).
            self._waiting_on_purpose = True
            try:
                wait = min(REVOKE_MARK_WAIT, self.hb_timeout / 4)
                self._step_down.leave(cut_off, now, wait, consumer.close, self._stop)
            finally:
                self._waiting_on_purpose = False
            self._consumer = self._new_consumer()  # an ordinary member again (when stopping, _run closes it)
            self._in_group_at = time.monotonic()
        self._last_pulse = time.monotonic()

    def _others(self, consumer: Consumer) -> int | None:
        """The leader group's members other than this one (see StepDown.anyone_to_hand_over_to)."""
        return other_members(self._admin_client(), self._group, consumer.memberid(), min(1.0, self.hb_timeout / 4))

    def _check_membership(self, now: float) -> None:
        """Replace the consumer when it has had no group member id for OUT_OF_GROUP_SESSIONS
        session timeouts.

        librdkafka's consumer can stay out of the group for good after a broker restart: its
        session timed out while the broker was down, it was left with no broker handle but the
        logical coordinator's, and so it never connected again, not even once the broker was back
        (https://github.com/confluentinc/librdkafka/issues/5301 is alike). A consumer that
        reaches the coordinator has a member id from its first JoinGroup reply on, as a standby
        too and while a rebalance waits for others; one without is in no group and holds no partition, so replacing it takes
        leadership from no one. During a long Kafka outage it is replaced every two sessions,
        which costs nothing."""
        consumer = self._consumer
        assert consumer is not None
        if consumer.memberid():
            self._in_group_at, self._group_error = now, None
            return
        out_of_group = now - self._in_group_at
        if out_of_group < OUT_OF_GROUP_SESSIONS * self.session_timeout:
            return
        self._log.warning(
            "leader consumer out of the group for long: replacing it",
            seconds=round(out_of_group, 1),
            last_error=self._group_error,
        )
        for lease in self.leases:  # none is held without a member id; never lead on a dropped consumer
            if lease.holding:
                lease.holding = False
                lease._m.revocations.inc()
                lease.set(FOLLOWER, None)
        self._consumer = self._new_consumer()
        self._in_group_at = time.monotonic()
        # Closed aside: a wedged librdkafka handle may take long to close, and this thread keeps the leases.
        threading.Thread(target=self._close, args=(consumer,), name="reaper-neli-close", daemon=True).start()

    def _close(self, consumer: Consumer) -> None:
        try:
            consumer.close()
        except Exception as exc:
            self._log.warning("replaced leader consumer: close failed", error=str(exc))

    def _run(self) -> None:
        assert self._consumer is not None and self._producer is not None  # start() made both before this ran
        self._last_pulse = self._in_group_at = time.monotonic()  # not from __init__: a slow start is no stall
        try:
            while not self._stop.is_set():
                try:
                    self._pulse()
                except KafkaException as exc:
                    self._log.warning("leader consumer error", error=str(exc))
                    time.sleep(self.min_poll)
                    self._last_pulse = time.monotonic()  # an error, not a stall of this process
        except Exception as exc:
            # Anything else (a callback's bug, a producer that cannot be made) ends the election:
            # said here, and kept in `error` so the process stops rather than stay up never leading.
            self.error = exc
            self._log.error("election thread failed: no unit will lead", error=str(exc), exc_info=exc)
        finally:
            for lease in self.leases:
                lease.holding = False
                lease.set(FOLLOWER, None)
            try:
                self._consumer.close()  # leaves the group: the partitions move without waiting for the session
            except Exception as exc:
                self._log.warning("leader consumer close failed", error=str(exc))
            self._producer.flush(1)
            self._closed.set()
