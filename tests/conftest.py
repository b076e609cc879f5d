"""Session fixtures for the real Postgres and Kafka.

OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP name running services; without them the local services are
brought up by deploy/local/services.py (idempotent). With OUTBOX_TESTCONTAINERS=1 and a Docker
engine, testcontainers starts them instead. A service that cannot be reached fails the run: these
tests never skip for want of a service.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient, NewTopic
from hypothesis import settings
from support.ci import under_ci
from support.in_flight import (  # noqa: F401
    pytest_keyboard_interrupt,
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
)
from support.ports import silent_listener
from support.teardown import drop_schema
from support.teardown import release_failed_frames as pytest_runtest_makereport  # noqa: F401

from tracker import schema as schema_mod

REPO = Path(__file__).resolve().parents[1]

# No per-example deadline: the suite runs more workers than cores, and one example held up by the
# scheduler would otherwise fail as "unreliable timings" while its property holds. A test that
# sets a deadline of its own keeps it.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
SERVICES = REPO / "deploy" / "local" / "services.py"


def _local_services() -> dict[str, str]:
    r = subprocess.run([sys.executable, str(SERVICES), "up"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.fail(f"could not bring up local services:\n{r.stdout}\n{r.stderr}", pytrace=False)
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line and not line.startswith("["))


def _testcontainers(request) -> dict[str, str]:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    pg = PostgresContainer("postgres:16-alpine", driver=None).start()
    kafka = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft().start()
    request.session.config.add_cleanup(pg.stop)
    request.session.config.add_cleanup(kafka.stop)
    return {"OUTBOX_TEST_DSN": pg.get_connection_url(), "KAFKA_BOOTSTRAP": kafka.get_bootstrap_server()}


@pytest.fixture(scope="session")
def services(request) -> dict[str, str]:
    env = {k: os.environ[k] for k in ("OUTBOX_TEST_DSN", "KAFKA_BOOTSTRAP") if os.environ.get(k)}
    if len(env) < 2:
        if os.environ.get("OUTBOX_TESTCONTAINERS") == "1":
            env = {**_testcontainers(request), **env}
        else:
            env = {**_local_services(), **env}
    return env


@pytest.fixture(scope="session")
def pg_dsn(services) -> str:
    dsn = services["OUTBOX_TEST_DSN"]
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        pytest.fail(f"Postgres at {dsn} is not reachable: {exc}", pytrace=False)
    return dsn


@pytest.fixture(scope="session")
def kafka_bootstrap(services) -> str:
    bootstrap = services["KAFKA_BOOTSTRAP"]
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        admin.list_topics(timeout=15)
    except Exception as exc:  # KafkaException: nothing answered
        pytest.fail(f"Kafka at {bootstrap} is not reachable: {exc}", pytrace=False)
    return bootstrap


@pytest.fixture(scope="session")
def pgbouncer_dsn(services, pg_dsn) -> str:
    """PgBouncer (transaction pooling) in front of the same Postgres as pg_dsn.

    PGBOUNCER_DSN names a running one; else deploy/local/services.py starts the local one. Connect
    with prepare_threshold=None (PgBouncer < 1.21 cannot carry prepared statements) and no
    session state (SET, search_path, LISTEN): see docs/howto/psycopg.md, "PgBouncer in transaction pooling mode".
    """
    dsn = os.environ.get("PGBOUNCER_DSN") or services.get("PGBOUNCER_DSN")
    if not dsn:
        r = subprocess.run(
            [sys.executable, str(SERVICES), "up", "--only", "pgbouncer"], capture_output=True, text=True, timeout=600
        )
        if r.returncode != 0:
            pytest.fail(f"could not bring up the local PgBouncer:\n{r.stdout}\n{r.stderr}", pytrace=False)
        dsn = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)["PGBOUNCER_DSN"]
    ident = "SELECT pg_postmaster_start_time(), current_database(), inet_server_port()"
    try:
        with psycopg.connect(dsn, connect_timeout=10, prepare_threshold=None, autocommit=True) as conn:
            behind = conn.execute(ident).fetchone()
    except psycopg.OperationalError as exc:
        pytest.fail(f"PgBouncer at {dsn} is not reachable: {exc}", pytrace=False)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        direct = conn.execute(ident).fetchone()
    if behind != direct:
        pytest.fail(f"PgBouncer at {dsn} leads to {behind}, not to the database of {pg_dsn} {direct}", pytrace=False)
    return dsn


@pytest.fixture
def pgbouncer_schema(pgbouncer_dsn, schema) -> str:
    """`schema` (migrated through the direct DSN) for a test that then works through PgBouncer."""
    return schema


def _fresh_schema(pg_dsn: str):
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, name)
    yield name
    drop_schema(pg_dsn, name)


@pytest.fixture
def schema(pg_dsn) -> str:
    """A freshly migrated schema of this test's own, dropped afterwards."""
    yield from _fresh_schema(pg_dsn)


@pytest.fixture
def other_schema(pg_dsn) -> str:
    """A second freshly migrated schema, as `schema` is, for tests of two schemas."""
    yield from _fresh_schema(pg_dsn)


@pytest.fixture
def silent_server() -> str:
    """host:port of a listener that accepts connections and never says a word (a database or a
    broker that hangs)."""
    with silent_listener() as address:
        yield address


@pytest.fixture
def bare_schema(pg_dsn) -> str:
    """An empty schema `reaper migrate` never ran in (as one holding an application's own outbox
    table), dropped afterwards."""
    name = f"bare_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')
    yield name
    drop_schema(pg_dsn, name, if_exists=False)


@pytest.fixture
def conn(pg_dsn, schema):
    """A psycopg connection (not autocommit) with search_path on the test's schema."""
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'SET search_path TO "{schema}", public')
        c.commit()
        yield c


class Topics:
    """Creates uniquely named topics for one test and deletes them after it."""

    def __init__(self, bootstrap: str) -> None:
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.created: list[str] = []

    def __call__(self, prefix: str = "t", partitions: int = 1, config: dict | None = None) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = self.admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1, config=config or {})], operation_timeout=30
        )
        futures[name].result(timeout=30)
        self.created.append(name)
        return name

    def delete_all(self) -> None:
        if self.created:
            for f in self.admin.delete_topics(self.created, operation_timeout=30).values():
                try:
                    f.result(timeout=30)
                except Exception:
                    pass  # already gone; topic names are unique, so leftovers harm nothing


@pytest.fixture
def topics(kafka_bootstrap):
    t = Topics(kafka_bootstrap)
    yield t
    t.delete_all()


@pytest.fixture(scope="module")
def cluster():
    """The local cluster (three Kafka brokers, a Postgres primary with a synchronous standby), up
    for the module's tests (deploy/local/services.py; fails, never skips, when it cannot start).

    Stopped after them when they started it, and always on CI: its three idle brokers take about
    a sixth of a core, which the rest of a suite on two cores needs (`make test` starts it before
    the workers, so that no test waits for three JVMs)."""
    from support.cluster import Cluster, ClusterError

    cluster = Cluster()
    was_running = cluster.running()
    try:
        cluster.up()
    except (ClusterError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"could not bring up the local cluster: {exc}", pytrace=False)
    yield cluster
    if under_ci() or not was_running:
        cluster.down()
