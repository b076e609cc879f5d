"""How bench.cluster measures a fault's publication gap: a writer committing numbered records, a
reader keeping when each came back (and when its leader appended it), a probe producer with the
reaper's settings but no reaper, and a watch of the other brokers' metadata for Kafka's failover."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from harvester.election.timeouts import silent_broker_wait_ms
from harvester.publishing.publisher import producer_config

PARTITIONS = 3
QUIET = {"log_level": 3}
# the probe's cadence: the resolution of kafka_writable; each round is an acks=all request per
# partition, which the brokers replicate, so it is load too (20 ms was 150 requests a second)
PROBE_EVERY = 0.05


class Writer(threading.Thread):
    """Commits 10 records per transaction at `rate` records/s over 30 keys through the multi-host
    DSN, reconnecting after a failover; remembers each record's commit time."""

    def __init__(self, dsn: str, schema: str, topic: str, rate: float = 500.0) -> None:
        super().__init__(daemon=True)
        self.dsn, self.schema, self.topic, self.rate = dsn, schema, topic, rate
        self.committed: dict[bytes, float] = {}
        self.stop = threading.Event()
        self.seq = 0

    def run(self) -> None:
        conn = None
        ins = f'INSERT INTO "{self.schema}".outbox (topic, key, value) VALUES (%s, %s, %s)'
        while not self.stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, connect_timeout=2)
                rows = []
                for _ in range(10):
                    self.seq += 1
                    rows.append((self.topic, b"k%d" % (self.seq % 30), b"%d" % self.seq))
                with conn.cursor() as cur:
                    cur.executemany(ins, rows)
                conn.commit()
                now = time.monotonic()
                for _t, _k, v in rows:
                    self.committed[v] = now
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
                continue
            time.sleep(10 / self.rate)
        if conn is not None:
            conn.close()


class Reader(threading.Thread):
    """Reads the topic back; keeps each value's first arrival time and partition (`arrived`), and
    the time its leader appended it (`appended`, the topic's LogAppendTime), both on this process's
    monotonic clock."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.arrived: dict[bytes, tuple[float, int]] = {}
        self.appended: dict[bytes, tuple[float, int]] = {}
        self.stop = threading.Event()
        self.c = Consumer(
            {
                **QUIET,
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-read-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                # Kafka's default: a fetch returns as soon as a record is there, and only waits this
                # long on an empty partition (10 ms had the brokers answering a hundred empty fetches
                # a second each, load of the bench's own on the cores the failover needs)
                "fetch.wait.max.ms": 500,
                # a silent (paused) leader is given up after 2 s, not librdkafka's 60 s: the gap
                # measured is the reaper's, the reader's own wait adds at most this
                "socket.timeout.ms": 2000,
                # and a moved leader is looked up within 250 ms, so the reaper's share of a gap is
                # not the reader's
                "topic.metadata.refresh.interval.ms": 250,
            }
        )
        self.c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])

    def run(self) -> None:
        while not self.stop.is_set():
            for m in self.c.consume(1000, 0.05):
                if m.error() is None:
                    now = time.monotonic()
                    self.arrived.setdefault(m.value(), (now, m.partition()))
                    kind, ms = m.timestamp()
                    if kind == TIMESTAMP_LOG_APPEND_TIME:  # the broker's wall clock, this machine's
                        self.appended.setdefault(m.value(), (now - (time.time() - ms / 1000), m.partition()))
        self.c.close()


class Probe(threading.Thread):
    """Kafka's own recovery as a client sees it: a producer with the reaper's data-producer
    settings (idempotent, acks=all, the same metadata refresh and waits) but none of the reaper
    (no election, no marking) writes a small record to every partition of the outbox topic every
    PROBE_EVERY seconds; `sent` keeps each record's send time. The Reader reads them back with the rest."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.topic = topic
        self.sent: dict[bytes, float] = {}
        self.stop = threading.Event()
        wait = silent_broker_wait_ms(5.0, 15.0)  # the reaper's defaults
        self.p = Producer({**producer_config(bootstrap, {}, {}, silent_wait_ms=wait), **QUIET})

    def run(self) -> None:
        seq = 0
        while not self.stop.is_set():
            for part in range(PARTITIONS):
                seq += 1
                value = b"probe-%d" % seq
                self.sent[value] = time.monotonic()
                self.p.produce(self.topic, value, partition=part)
            self.p.poll(PROBE_EVERY)
        self.p.flush(5)


def gap_after(
    writer: Writer | Probe, reader: Reader, since: float, timeout: float = 120, appended: bool = False
) -> float | None:
    """Seconds from `since` until every partition has read back a record committed (for the
    probe: sent) after `since` (the longest-waiting partition's first such record); with
    `appended`, until its leader appended it (waiting as long for it to be read back)."""
    sent = writer.committed if isinstance(writer, Writer) else writer.sent
    times = reader.appended if appended else reader.arrived
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        first: dict[int, float] = {}
        for v, (at, p) in list(times.items()):
            c = sent.get(v)
            # read back (or appended) after the fault too: a row whose commit returned just after
            # the signal may have been appended by the old leader before it
            if c is not None and c >= since and at >= since and (p not in first or at < first[p]):
                first[p] = at
        if len(first) == PARTITIONS:
            return round(max(first.values()) - since, 3)
        time.sleep(0.2)
    return None


def coordinator_partition(group: str, partitions: int) -> int:
    """The __consumer_offsets partition whose leader coordinates `group` (Kafka: the group id's
    Java hashCode, made non-negative, modulo the partition count)."""
    h = 0
    for ch in group:
        h = (31 * h + ord(ch)) & 0xFFFFFFFF
    return (h & 0x7FFFFFFF) % partitions


class FailoverWatch(threading.Thread):
    """Kafka's own share of a broker fault: polls the metadata of the brokers other than the
    victim until no partition of `topics`, nor the election group's coordinator partition, names
    the victim (or nobody) as its leader; `at` is then
    when that was first seen (monotonic), None until then."""

    def __init__(self, bootstrap: str, victim: int, topics: list[str], group: str, timeout: float = 120) -> None:
        super().__init__(daemon=True)
        others = [b for i, b in enumerate(bootstrap.split(","), start=1) if i != victim]
        # a short socket timeout: a paused broker named in the metadata must not hold the watch up
        self.admin = AdminClient({**QUIET, "bootstrap.servers": ",".join(others), "socket.timeout.ms": 1000})
        self.victim, self.topics, self.group, self.timeout = victim, topics, group, timeout
        self.at: float | None = None

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                md = self.admin.list_topics(timeout=1)
            except Exception:  # noqa: BLE001  (a broker refusing: ask again)
                time.sleep(0.05)
                continue
            leaders = [p.leader for t in self.topics if t in md.topics for p in md.topics[t].partitions.values()]
            offsets = md.topics.get("__consumer_offsets")
            if offsets is not None and offsets.partitions:  # the election group's coordinator moves too
                leaders.append(offsets.partitions[coordinator_partition(self.group, len(offsets.partitions))].leader)
            if leaders and all(lead not in (-1, self.victim) for lead in leaders):
                self.at = time.monotonic()
                return
            time.sleep(0.05)


def split(gap: float | None, since: float, watch: FailoverWatch, writable: float | None) -> dict[str, float | None]:
    """A fault's gap in Kafka's share and the reaper's: `kafka_failover`, until the other brokers'
    metadata names a live leader for every partition; `kafka_writable`, until the probe's first
    record sent after the fault was read back from every partition (the new leaders also
    acknowledge acks=all writes, and a client has found them); `reaper`, the rest of the gap."""
    kafka = None if watch.at is None else round(watch.at - since, 3)
    reaper = None if gap is None or writable is None else round(gap - writable, 3)
    return {"gap": gap, "kafka_failover": kafka, "kafka_writable": writable, "reaper": reaper}
