"""The local cluster (deploy/local/cluster.py: three Kafka brokers, a Postgres primary with a
synchronous standby) for fault tests and benchmarks: its control, and a load with a ledger.

The load is what an application does: writers committing numbered records per key, fan-outs
(a batch of items, enqueued and closed in one transaction), consumers acking every item through
the ack topic; reapers publish and fold the acks. The ledger check: every committed record
published (per key in order, duplicates allowed), and every committed batch completed by exactly
one completion event.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

import tracker
from tracker import outbox
from tracker.consumer import AckProducer, item_id_of

from .harness import Receiver, wait_until

SERVICES = Path(__file__).resolve().parents[2] / "deploy" / "local" / "services.py"
QUIET = {"log_level": 3}  # librdkafka: errors only, the faults are on purpose


class ClusterError(RuntimeError):
    pass


class Cluster:
    """Drives `services.py cluster ...`; `up()` is idempotent and also heals what a test broke."""

    def __init__(self) -> None:
        self.env: dict[str, str] = {}

    def _run(self, *args: str, timeout: float = 600) -> str:
        r = subprocess.run(
            [sys.executable, str(SERVICES), "cluster", *args], capture_output=True, text=True, timeout=timeout
        )
        if r.returncode != 0:
            raise ClusterError(f"cluster {' '.join(args)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r.stdout

    def up(self) -> Cluster:
        out = self._run("up")
        self.env = dict(line.split("=", 1) for line in out.splitlines() if line.startswith("CLUSTER_"))
        return self

    def running(self) -> bool:
        """Every broker answers and both Postgres nodes are up (`services.py cluster status`)."""
        r = subprocess.run(
            [sys.executable, str(SERVICES), "cluster", "status"], capture_output=True, text=True, timeout=120
        )
        return r.returncode == 0

    def down(self) -> None:
        self._run("down")

    @property
    def dsn(self) -> str:
        return self.env["CLUSTER_PG_DSN"]

    @property
    def bootstrap(self) -> str:
        return self.env["CLUSTER_KAFKA_BOOTSTRAP"]

    def kill_broker(self, n: int) -> float | None:
        """SIGKILL broker n; returns when the signal was sent (time.monotonic()), None if it was not running."""
        return _signalled_at(self._run("kill-broker", str(n)))

    def stop_broker(self, n: int) -> None:
        self._run("stop-broker", str(n))

    def start_broker(self, n: int) -> None:
        self._run("start-broker", str(n))

    def pause_broker(self, n: int) -> float | None:
        """SIGSTOP broker n; returns when the signal was sent (time.monotonic()), None if it was not running."""
        return _signalled_at(self._run("pause-broker", str(n)))

    def resume_broker(self, n: int) -> None:
        self._run("resume-broker", str(n))

    def controller(self) -> int:
        return int(self._run("controller").strip())

    def pg_kill(self, n: int) -> None:
        self._run("pg-kill", str(n))

    def primary(self) -> int:
        for line in self._run("status", timeout=60).splitlines():
            if line.startswith("postgres node") and ": primary" in line:
                return int(line.split()[2].rstrip(":"))
        raise ClusterError("no Postgres node is primary")

    def promote(self) -> int:
        out = self._run("promote")
        return int(out.strip().rsplit("node", 1)[1])

    def rejoin(self) -> None:
        self._run("rejoin")

    def topic_leaders(self, topic: str) -> dict[int, int]:
        md = AdminClient({"bootstrap.servers": self.bootstrap, **QUIET}).list_topics(topic, timeout=10)
        return {p: m.leader for p, m in md.topics[topic].partitions.items()}

    def group_coordinator(self, group: str) -> int:
        """Node id of the broker coordinating consumer group `group`."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap, **QUIET})
        return admin.describe_consumer_groups([group])[group].result(timeout=30).coordinator.id

    def wait_in_sync(self, topics: list[str], timeout: float = 60) -> bool:
        """Every partition of `topics` has all three replicas in sync (before the next restart)."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap, **QUIET})

        def whole() -> bool:
            try:
                md = admin.list_topics(timeout=5)
            except KafkaException:
                return False
            return all(len(p.isrs) == 3 for t in topics for p in md.topics[t].partitions.values())

        return wait_until(whole, timeout, step=0.2)


def _signalled_at(out: str) -> float | None:
    for line in out.splitlines():
        if line.startswith("signalled_at="):
            value = line.split("=", 1)[1].strip()
            return None if value == "None" else float(value)
    return None


class ClusterTopics:
    """Topics on the cluster with the brokers' defaults (replication factor 3, min ISR 2)."""

    def __init__(self, bootstrap: str) -> None:
        self.admin = AdminClient({"bootstrap.servers": bootstrap, **QUIET})
        self.created: list[str] = []

    def __call__(self, prefix: str, partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        # A broker an earlier test killed or restarted may not have registered again with the
        # controller yet (the brokers' metadata can list it before the controller unfences it): a topic
        # of replication factor 3 needs all three, so creation is retried until they are.
        deadline, tried = time.monotonic() + 120, False
        while True:
            futures = self.admin.create_topics([NewTopic(name, num_partitions=partitions)], operation_timeout=30)
            try:
                futures[name].result(timeout=60)
                break
            except KafkaException as e:
                code = e.args[0].code()
                if tried and code == KafkaError.TOPIC_ALREADY_EXISTS:
                    break  # an earlier attempt that reported a failure (or timed out) made it after all
                if code not in (KafkaError.INVALID_REPLICATION_FACTOR, KafkaError.REQUEST_TIMED_OUT) or (
                    time.monotonic() > deadline
                ):
                    raise
                tried = True
                time.sleep(0.5)
        self.created.append(name)
        return name

    def delete_all(self) -> None:
        if self.created:
            for f in self.admin.delete_topics(self.created, operation_timeout=30).values():
                try:
                    f.result(timeout=30)
                except Exception:
                    pass  # unique names: a leftover harms nothing


class FanOuts:
    """Opens, fills and closes a batch of `items` items every `interval` seconds, each in one
    transaction; survives a database failover by reconnecting. `committed`: batches whose
    transaction committed; `ambiguous`: whose commit failed with the connection lost."""

    def __init__(self, dsn: str, schema: str, item_topic: str, completion_topic: str, items: int = 40) -> None:
        self.dsn, self.schema, self.items = dsn, schema, items
        self.item_topic, self.completion_topic = item_topic, completion_topic
        self.committed: set[int] = set()
        self.ambiguous: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fan-outs")
        self.error: BaseException | None = None

    def start(self, interval: float = 0.5) -> FanOuts:
        self.interval = interval
        self._thread.start()
        return self

    def _run(self) -> None:
        conn: psycopg.Connection | None = None
        n = 0
        try:
            while not self._stop.is_set():
                batch_id = None
                try:
                    if conn is None or conn.closed:
                        conn = psycopg.connect(self.dsn, connect_timeout=3)
                    batch = tracker.open_batch(
                        conn, user_key=f"fan-{n}", completion_topic=self.completion_topic, schema=self.schema
                    )
                    batch_id = batch.id
                    msgs = (outbox.Message(json.dumps({"n": i}), key=f"item-{i % 7}") for i in range(self.items))
                    outbox.enqueue(conn, batch, msgs, topic=self.item_topic, schema=self.schema)
                    tracker.close_batch(conn, batch, schema=self.schema)
                    try:
                        conn.commit()
                    except psycopg.OperationalError:
                        self.ambiguous.add(batch_id)
                        raise
                    self.committed.add(batch_id)
                    n += 1
                except psycopg.OperationalError:
                    if conn is not None:
                        conn.close()
                    conn = None
                    time.sleep(0.2)
                    continue
                self._stop.wait(self.interval)
        except BaseException as exc:  # a failing writer must fail the test, not vanish
            self.error = exc
        finally:
            if conn is not None:
                conn.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise self.error


class Consumers:
    """A consumer group on the item topic that acks every item through the ack topic (acks
    flushed before offsets are committed: a crash re-delivers, a re-ack is harmless)."""

    def __init__(self, bootstrap: str, item_topic: str, ack_topic: str) -> None:
        self.bootstrap, self.item_topic, self.ack_topic = bootstrap, item_topic, ack_topic
        self.processed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="consumers")
        self.error: BaseException | None = None

    def start(self) -> Consumers:
        self._thread.start()
        return self

    def _run(self) -> None:
        consumer = Consumer(
            {
                **QUIET,
                "bootstrap.servers": self.bootstrap,
                "group.id": f"items-{uuid.uuid4().hex[:8]}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
            }
        )
        acks = AckProducer(bootstrap_servers=self.bootstrap, topic=self.ack_topic, kafka_client=dict(QUIET))
        consumer.subscribe([self.item_topic])
        try:
            while not self._stop.is_set():
                ids = [item_id_of(m) for m in consumer.consume(2000, timeout=0.2) if m.error() is None]
                if ids:
                    acks.ack(ids)
                    acks.flush()
                    try:
                        consumer.commit(asynchronous=False)
                    except KafkaException:
                        pass  # re-delivered later, acked again: idempotent
                    self.processed += len(ids)
        except BaseException as exc:
            self.error = exc
        finally:
            acks.close()
            consumer.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise self.error


def check_completions(receiver: Receiver, fan: FanOuts, timeout: float = 120) -> None:
    """Every committed batch completed, by exactly one completion event (republished copies of the
    same event allowed); no event for a batch that never committed."""

    def events() -> dict[int, set[bytes | None]]:
        out: dict[int, set[bytes | None]] = defaultdict(set)
        with receiver._lock:
            for key, value, _h in receiver.records:
                if key is not None:
                    out[int(key)].add(value)
        return out

    done = wait_until(lambda: fan.committed <= set(events()), timeout, step=0.2)
    got = events()
    assert done, f"{len(fan.committed - set(got))} of {len(fan.committed)} committed batches never completed"
    several = {b: len(v) for b, v in got.items() if len(v) != 1}
    assert several == {}, f"batches with more than one completion event: {several}"
    assert set(got) <= fan.committed | fan.ambiguous, set(got) - fan.committed - fan.ambiguous
