"""Helpers for harvester tests: configuration, outbox writers, a Kafka receiver, waiting."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator

import psycopg
from confluent_kafka import Consumer, TopicPartition

from harvester import config as config_mod
from harvester.units import Harvester
from tracker.message_ids import Namespace

FAST = {  # short timeouts keep failure tests quick
    "min_poll_interval": 0.1,
    "heartbeat_timeout": 1.0,
    "session_timeout": 3.0,
    "drain_timeout": 5.0,
    "idle_poll_interval": 0.005,
}


def make_config(
    pg_dsn: str,
    schema: str,
    bootstrap: str,
    *,
    leader_topic: str | None = None,
    group: str | None = None,
    harvester: dict | None = None,
    **sections,
) -> config_mod.Config:
    h = {
        **FAST,
        "leader_topic": leader_topic or f"leader-{uuid.uuid4().hex[:10]}",
        "leader_group": group or f"g-{uuid.uuid4().hex[:10]}",
        **(harvester or {}),
    }
    overrides = {
        "database": {"dsn": pg_dsn, "schema": schema},
        "kafka": {"bootstrap_servers": bootstrap},
        "harvester": h,
        "metrics": {"enabled": False},
        **sections,
    }
    return config_mod.load(None, environ={}, overrides=overrides)


def lanes_config(pg_dsn: str, schema: str, bootstrap: str, topics, lanes: int, **harvester) -> config_mod.Config:
    """make_config harvesting the outbox in `lanes` lanes, on a leader topic of its own with one
    partition per lane (`topics` is conftest's topic factory)."""
    return make_config(
        pg_dsn,
        schema,
        bootstrap,
        leader_topic=topics("leader", partitions=lanes),
        harvester={"lanes": lanes, **harvester},
    )


def env_for(cfg: config_mod.Config) -> dict[str, str]:
    """REAPER_* variables that reproduce cfg's database, kafka and harvester keys for a subprocess."""
    env = {
        "REAPER_DATABASE__DSN": cfg.database.dsn,
        "REAPER_DATABASE__SCHEMA": cfg.database.schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": cfg.kafka.bootstrap_servers,
    }
    for key in (
        "leader_topic",
        "leader_group",
        "min_poll_interval",
        "heartbeat_timeout",
        "session_timeout",
        "drain_timeout",
        "idle_poll_interval",
        "mark_batch",
        "max_in_flight",
    ):
        env[f"REAPER_HARVESTER__{key.upper()}"] = str(getattr(cfg.harvester, key))
    if cfg.harvester.transactional_id:
        env["REAPER_HARVESTER__TRANSACTIONAL_ID"] = cfg.harvester.transactional_id
    return env


def insert_rows(
    conn: psycopg.Connection,
    schema: str,
    topic: str,
    rows: Iterable[tuple[bytes | None, bytes | None]],
    headers: list[tuple[str, bytes]] | None = None,
) -> int:
    """Insert (key, value) rows in one transaction (committed); return how many."""
    hk = [h[0] for h in headers or []]
    hv = [h[1] for h in headers or []]
    data = [(topic, k, v, hk, hv) for k, v in rows]
    with conn.cursor() as cur:
        cur.executemany(
            f'INSERT INTO "{schema}".outbox (topic, key, value, header_keys, header_values) '
            "VALUES (%s, %s, %s, %s, %s)",
            data,
        )
    conn.commit()
    return len(data)


@contextlib.contextmanager
def limited_role(pg_dsn: str, schema: str, prefix: str, table_grants: str = "") -> Iterator[str]:
    """A login role with USAGE on `schema` (and `table_grants` on its tables, e.g. "SELECT, UPDATE"),
    owning nothing; yields its DSN and drops it afterwards."""
    role = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        if table_grants:
            conn.execute(f'GRANT {table_grants} ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
    try:
        yield pg_dsn.replace("postgres@", f"{role}@")
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{schema}" FROM {role}')
            conn.execute(f'REVOKE ALL ON SCHEMA "{schema}" FROM {role}')
            conn.execute(f"DROP ROLE {role}")


def outbox_count(pg_dsn: str, schema: str) -> int:
    with psycopg.connect(pg_dsn) as c:
        return c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0]


def outbox_marks(pg_dsn: str, schema: str) -> dict[int, uuid.UUID | None]:
    """Each row of `schema`.outbox: its id -> the leader id it is marked with (None: unmarked)."""
    with psycopg.connect(pg_dsn) as c:
        return dict(c.execute(f'SELECT id, leader_id FROM "{schema}".outbox ORDER BY id').fetchall())


class Receiver:
    """Consumes a topic from the beginning in a thread; keeps every record in arrival order."""

    def __init__(self, bootstrap: str, topic: str, partitions: int = 1, conf: dict | None = None) -> None:
        self.records: list[tuple[bytes | None, bytes | None, list]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._c = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"recv-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
                "isolation.level": "read_uncommitted",
                **(conf or {}),
            }
        )
        self._c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for msg in self._c.consume(10000, 0.1):
                if msg.error() is None:
                    with self._lock:
                        self.records.append((msg.key(), msg.value(), msg.headers() or []))

    def values(self) -> list[bytes]:
        with self._lock:
            return [v for _, v, _ in self.records]

    def snapshot(self) -> list[tuple[bytes | None, bytes | None, list]]:
        """The records received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self.records)

    def unique(self) -> set:
        with self._lock:
            return {(k, v) for k, v, _ in self.records}

    def wait_for(self, expected: set, timeout: float) -> bool:
        return wait_until(lambda: expected <= self.unique(), timeout)

    def close(self) -> None:
        self._stop.set()
        self._t.join(5)
        self._c.close()


def wait_until(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def heartbeats_flowing(neli, timeout: float = 30.0) -> bool:
    """Whether a heartbeat of `neli` (harvester.election.neli.Neli) came back after this call,
    within `timeout`: its heartbeats are flowing, however slow the machine."""
    since = time.monotonic()
    return wait_until(lambda: neli.heartbeat_back_at > since, timeout)


def wait_for(predicate: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> None:
    """wait_until that fails the test, naming `what`, when the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def running(cfg: config_mod.Config, faults=None, drain_timeout: float = 10) -> Iterator[Harvester]:
    """A harvester on cfg, leading within 30 s; stopped afterwards, and it must not have failed.
    `faults`: a FaultPlan or HeldHeartbeats (anything with providers())."""
    h = Harvester(cfg, **({"providers": faults.providers()} if faults is not None else {})).start()
    try:
        assert wait_until(lambda: h.leading, 30), "the reaper never became leader"
        yield h
    finally:
        h.stop(drain_timeout=drain_timeout)
        assert h.error is None, h.error


def order_violations(records: Iterable[tuple[bytes | None, bytes | None]]) -> list[str]:
    """Per key, first appearances must come in increasing sequence order (duplicates allowed).

    Values are b"<key>:<seq>"; a record first seen after a higher sequence of its key is a regression.
    """
    seen: dict[bytes, set[int]] = defaultdict(set)
    high: dict[bytes, int] = {}
    bad = []
    for key, value in records:
        seq = int(value.rsplit(b":", 1)[1])
        if seq in seen[key]:
            continue
        if key in high and seq < high[key]:
            bad.append(f"key {key!r}: {seq} first seen after {high[key]}")
        seen[key].add(seq)
        high[key] = max(high.get(key, seq), seq)
    return bad


class Generator:
    """Commits records over many keys, several per transaction, numbering each key's records 0, 1, 2...

    Values are b"<key>:<seq>". `committed` holds every (key, value) whose transaction committed.
    """

    def __init__(self, pg_dsn: str, schema: str, topic: str, keys: int = 50, per_txn: int = 20) -> None:
        self.pg_dsn, self.schema, self.topic, self.per_txn = pg_dsn, schema, topic, per_txn
        self.keys = [f"key-{i}".encode() for i in range(keys)]
        self.next_seq = {k: 0 for k in self.keys}
        self.committed: set[tuple[bytes, bytes]] = set()
        self.ambiguous: set[tuple[bytes, bytes]] = set()  # commit failed with a lost connection
        self._i = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _rows(self) -> list[tuple[bytes, bytes]]:
        rows = []
        for _ in range(self.per_txn):
            key = self.keys[self._i % len(self.keys)]
            self._i += 7 if self._i % 3 else 1  # uneven spread: several records of one key per transaction
            rows.append((key, key + b":" + str(self.next_seq[key]).encode()))
            self.next_seq[key] += 1
        return rows

    def commit_once(self, conn: psycopg.Connection) -> None:
        rows = self._rows()
        insert_rows(conn, self.schema, self.topic, rows)
        self.committed.update(rows)

    def run_for(self, seconds: float, rate_per_s: float = 1000.0) -> None:
        """Commit for `seconds`; survives a database restart by reconnecting.

        A commit that fails with a connection error may or may not have committed: its rows go to
        `ambiguous` and the test accepts them either way.
        """
        end = time.monotonic() + seconds
        conn = None
        while time.monotonic() < end and not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.pg_dsn, connect_timeout=3)
                rows = self._rows()
                try:
                    insert_rows(conn, self.schema, self.topic, rows)
                except psycopg.OperationalError:
                    self.ambiguous.update(rows)
                    raise
                self.committed.update(rows)
            except psycopg.OperationalError:
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.2)
                continue
            time.sleep(self.per_txn / rate_per_s)
        if conn is not None:
            conn.close()

    def start(self, rate_per_s: float = 1000.0) -> Generator:
        def loop() -> None:
            try:
                self.run_for(1e9, rate_per_s)
            except BaseException as exc:  # a failing generator must fail the test, not vanish
                self.error = exc

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self.error is not None:
            raise self.error


def read_messages(bootstrap: str, topic: str, n: int, timeout: float = 30.0, linger: float = 0.0) -> list:
    """Read a topic from the start until `n` messages (or `timeout`); then keep reading `linger`
    seconds more, so a test can show nothing arrived beyond n."""
    c = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    c.subscribe([topic])
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend(m for m in c.consume(1000, 0.5) if not m.error())
    end = time.monotonic() + linger
    while time.monotonic() < end:
        got.extend(m for m in c.consume(1000, 0.2) if not m.error())
    c.close()
    return got


def check_published(receiver: Receiver, gen: Generator, timeout: float = 120) -> None:
    """Every committed record arrived, per key in order (duplicates allowed), and nothing arrived
    that was never committed (or whose commit's outcome is unknown)."""
    assert receiver.wait_for(gen.committed, timeout), (
        f"lost {len(gen.committed - receiver.unique())} of {len(gen.committed)} committed records"
    )
    time.sleep(0.5)
    assert order_violations([(k, v) for k, v, _ in receiver.records]) == []
    assert receiver.unique() <= gen.committed | gen.ambiguous


def marked(pg_dsn: str, schema: str, limit: int = 100) -> tuple[Namespace, list[tuple]]:
    """(namespace, rows): `schema`.outbox's rows marked as the harvester marks them, under a fresh
    leader id, and the message-id namespace read as it reads it."""
    from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool

    pool = make_pool(pg_dsn, 1)
    try:
        store = OutboxStore(pool, schema)
        return store.namespace(), store.mark(uuid.uuid4(), limit, until=FOREVER)
    finally:
        pool.close()
