"""The heartbeats of the election's leases (harvester.election.neli): each leader's, produced to its
unit's partition at most every `min_poll_interval`, vouched for by the broker's acknowledgement or
by reading it back, and judged: a lease fences when none sent within `heartbeat_timeout` has come
back, and resumes once they come back steadily (harvester.election.resumption). A fence that lasts
is reported with why (harvester.election.diagnosis), and a heartbeat producer that got nothing back
for that long is replaced. `Heartbeats` is that work, run by Neli's election thread, on Neli's state.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message

from harvester.election.diagnosis import FencedReports
from harvester.election.lease import FENCED, LEADER, Lease
from harvester.election.resumption import Resumption
from harvester.publishing.ports import ProducerFactory, ProducerLike


class Heartbeats:
    """Send, vouch for and judge the leases' heartbeats; replace a heartbeat producer gone silent.
    The state below is Neli's, made by its __init__ and start()."""

    topic: str
    instance: bytes  # tags this process's heartbeats
    min_poll: float
    hb_timeout: float
    leases: list[Lease]
    _log: Any
    _resumptions: list[Resumption]
    _reports: FencedReports
    _consumer: Consumer | None
    _producer: ProducerLike | None
    _producer_conf: dict
    _make_producer: ProducerFactory
    _producer_made: float  # monotonic: when the heartbeat producer in use was made
    _back_at: float  # monotonic: when a heartbeat of any unit last came back
    _resume_after: float  # monotonic: no resumption before this (see neli.RESUME_GRACE)

    def _vouch(self, partition: int | None, value: bytes | None) -> None:
        """One of this process's heartbeats reached the broker (acknowledged, or read back): its
        unit's lease holds until `heartbeat_timeout` after it was SENT. One sent before a pause
        (SIGSTOP, a long stall) and seen after it must not revive the leadership it outlived."""
        if partition is None or not 0 <= partition < len(self.leases):
            return
        sent_at = self._sent_at(value)
        if sent_at is not None:
            lease = self.leases[partition]
            lease.last_heartbeat = max(lease.last_heartbeat, sent_at)
            self._back_at = time.monotonic()
            self._reports.back(partition, self._back_at - sent_at)

    def _acked(self, err: KafkaError | None, msg: Message) -> None:
        """The broker appended a heartbeat: the same evidence as reading it back, one trip through
        the broker's request queue sooner (reading it back waits for the consumer's next fetch
        request too, which under load doubled the measured gap and fenced leaders of a slow but
        reachable broker). Served by producer.poll in this thread."""
        if err is None:
            self._vouch(msg.partition(), msg.value())
        elif (partition := msg.partition()) is not None:
            self._reports.failed(partition, err)

    def _beat(self, lease: Lease, now: float) -> None:
        if now - lease.last_sent >= self.min_poll:
            lease.last_sent = now
            assert self._producer is not None  # only called from _pulse, after start()
            try:
                self._producer.produce(
                    self.topic,
                    value=b"%s:%d" % (self.instance, time.monotonic_ns()),
                    partition=lease.unit,
                    on_delivery=self._acked,
                )
            except BufferError:
                pass  # Kafka unreachable for long: the missing heartbeats fence us
        overdue = now - lease.last_heartbeat > self.hb_timeout
        resumption = self._resumptions[lease.unit]
        if lease.state == LEADER and overdue:
            resumption.fenced(now)
            lease._m.fences.inc()
            self._log.warning(
                "no heartbeat within heartbeat_timeout: fencing",
                heartbeat_timeout=self.hb_timeout,
                unit=lease.unit,
                leader_id=str(lease._leader_id),
                resume_steady_s=resumption.needed,
            )
            lease.set(FENCED, None)
        elif lease.state == FENCED and resumption.ready(now, lease.last_heartbeat, now >= self._resume_after):
            self._log.info(
                "heartbeats are back and the partition is still held: resuming",
                unit=lease.unit,
                steady_s=round(resumption.steady_for(), 3),
                heartbeat_age_s=round(now - lease.last_heartbeat, 3),
            )
            resumption.resumed(now)
            lease.acquire(resumed=True)
        elif lease.state == FENCED and self._reports.due(lease.unit, resumption.fenced_at, now):
            self._report_fenced(lease, resumption, now)

    def _report_fenced(self, lease: Lease, resumption: Resumption, now: float) -> None:
        """A unit fenced for long: say what its resumption waits for (harvester.election.diagnosis)."""
        consumer, producer = self._consumer, self._producer
        in_group = bool(consumer is not None and consumer.memberid())
        unanswered = len(producer) if producer is not None else 0
        self._reports.report(
            lease,
            resumption,
            now,
            in_group=in_group,
            unanswered=unanswered,
            grace_left=max(0.0, self._resume_after - now),
        )
        since = max(self._back_at, self._producer_made)
        if in_group and now - since > self._reports.every and (unanswered or self._reports.failed_at > since):
            self._replace_producer(now)  # heartbeats went out, none came back

    def _replace_producer(self, now: float) -> None:
        """Replace a heartbeat producer that got no heartbeat of any unit back for as long as a
        fence is reported after, while the leader consumer is in the group.

        The heartbeat producer is the one election client that lives as long as the process (a
        consumer out of the group is replaced, the data producer is retired at every fence): a lone
        leader fenced right after leading again once its single broker restarted under load, and
        stayed fenced for minutes while its fresh data producer and consumer worked, which a heartbeat
        producer that never got an answer again explains best. A new one costs a connection. Safe:
        the old one is no longer polled, so nothing it sent vouches for anything any more (and it
        sent nothing fresher than the new one will), and a fenced lease still resumes only on its
        heartbeats coming back steadily (harvester.election.resumption)."""
        old = self._producer
        self._producer, self._producer_made = self._make_producer(self._producer_conf), now
        self._log.warning(
            "heartbeat producer got nothing back for long: replacing it",
            silent_s=round(now - self._back_at, 1) if self._back_at else None,
            unanswered=len(old) if old is not None else None,
        )
        if old is not None:  # closed aside: a wedged client may take long to close, and this thread keeps the leases
            threading.Thread(target=_discard, args=(old,), name="reaper-neli-close", daemon=True).start()

    def _sent_at(self, value: bytes | None) -> float | None:
        """The monotonic send time of one of this process's heartbeats; None for anything else."""
        instance, sep, stamp = (value or b"").partition(b":")
        if not sep or instance != self.instance or not stamp.isdigit():
            return None
        return int(stamp) / 1e9


def _discard(producer: ProducerLike) -> None:
    """Drop what a replaced heartbeat producer still holds (worthless heartbeats) and let it go,
    never polled again: its reports would vouch from another thread than the election's."""
    try:
        producer.purge(in_queue=True, in_flight=True)
    except Exception:
        pass  # a wedged client may refuse; nothing of it is used any more
