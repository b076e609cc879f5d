"""The `message-id` header: on every record the harvester publishes, whatever wrote the row (Python,
the SQL functions, a plain INSERT, the tracker's completion and expiry events), in every unit and
lane, plain or fenced; the same every time a row is published again; never the same for two rows of
two outbox tables; kept by an upgrade that rewrites no table."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.faults import FaultPlan
from support.harness import Receiver, make_config, marked, wait_until
from support.history import sql_at
from support.teardown import drop_schema

import tracker
from harvester.publishing.ports import DEFAULT, Providers
from harvester.units import Harvester
from tracker import expiry, message_ids
from tracker import schema as schema_mod
from tracker.errors import InvalidValue
from tracker.message_ids import MESSAGE_ID_HEADER, NamespaceUnavailable

PREVIOUS = "833fe98"  # the last commit whose schema has no message-id namespace
PARTITIONS = 3


def _namespace(pg_dsn: str, schema: str, table: str = "outbox") -> message_ids.Namespace:
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        return message_ids.namespace(c, schema, table)


def _write_every_kind(pg_dsn: str, schema: str, topic: str, tag: str) -> None:
    """Rows from each kind of writer, each with a value unique to it."""
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'SET search_path TO "{schema}"')
        # A plain INSERT, with and without headers of its own, keyed and not (lanes).
        for i in range(40):
            hk, hv = (["origin"], [b"test"]) if i % 2 else ([], [])
            c.execute(
                "INSERT INTO outbox (topic, key, value, header_keys, header_values) VALUES (%s, %s, %s, %s, %s)",
                [topic, None if i % 7 == 0 else b"k%d" % (i % 5), f"{tag}-insert-{i}".encode(), hk, hv],
            )
        # Python's enqueue.
        batch = tracker.open_batch(c, completion_topic=topic, schema=schema)
        tracker.outbox.enqueue(c, batch, [f"{tag}-py-{i}" for i in range(10)], topic=topic, schema=schema)
        (sql_batch,) = c.execute("SELECT open_batch(completion_topic => %s)", [topic]).fetchone()
        # The SQL functions other languages call.
        c.execute(
            "SELECT * FROM enqueue(%s, %s, %s)", [sql_batch, topic, [f"{tag}-sql-{i}".encode() for i in range(10)]]
        )
        c.commit()
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'SET search_path TO "{schema}"')
        (empty,) = c.execute("SELECT open_batch(completion_topic => %s)", [topic]).fetchone()
        c.execute("SELECT close_batch(%s, %s)", [empty, topic])  # nothing pending: complete, one event
        c.commit()
        expiry.expire_batch(c, sql_batch, schema=schema, completion_topic=topic)  # the expiry event
        c.commit()


def _snapshot(pg_dsn: str, schema: str) -> dict[bytes, int]:
    """value -> outbox row id of every row waiting in `schema`'s outbox."""
    with psycopg.connect(pg_dsn) as c:
        return {bytes(v): i for i, v in c.execute(f'SELECT id, value FROM "{schema}".outbox')}


def _expected(pg_dsn: str, schema: str, table: str = "outbox") -> dict[bytes, str]:
    """value -> the message id of every row waiting in `schema.table`, computed in Python from the
    row's id and `created_at` (the harvester has it from SQL: the two must agree)."""
    ns = _namespace(pg_dsn, schema, table)
    with psycopg.connect(pg_dsn) as c:
        rows = c.execute(f'SELECT id, value, created_at FROM "{schema}"."{table}"').fetchall()
    return {bytes(v): message_ids.message_id(ns, i, at) for i, v, at in rows}


def _ids_by_value(receiver: Receiver) -> dict[bytes, list[list[bytes]]]:
    """value -> for each record of it received, the values of its message-id headers."""
    out: dict[bytes, list[list[bytes]]] = defaultdict(list)
    with receiver._lock:
        records = list(receiver.records)
    for _, value, headers in records:
        out[value].append([v for k, v in headers if k == MESSAGE_ID_HEADER])
    return out


@pytest.mark.parametrize("fenced", [False, True], ids=["plain", "transactional"])
def test_every_record_of_every_unit_and_lane_carries_its_rows_message_id(
    pg_dsn, kafka_bootstrap, schema, other_schema, topics, fenced
):
    topic = topics("data", partitions=PARTITIONS)
    outboxes = [{"name": "a", "schema": schema, "lanes": 2}, {"name": "b", "schema": other_schema}]
    harvester = {"outboxes": outboxes, **({"transactional_id": f"t-{uuid.uuid4().hex[:10]}"} if fenced else {})}
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader", partitions=3), harvester=harvester)
    expected: dict[bytes, str] = {}
    for s in (schema, other_schema):
        _write_every_kind(pg_dsn, s, topic, s)
        expected.update(_expected(pg_dsn, s))
    assert len(expected) == 2 * (40 + 10 + 10 + 2)  # and a completion and an expiry event in each
    assert len(set(expected.values())) == len(expected)  # no id of one table is an id of the other
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    h = Harvester(cfg).start()
    try:
        assert wait_until(lambda: set(expected) <= set(receiver.values()), 60), "not everything was published"
        assert sorted(h.leading_units()) == ["a.0", "a.1", "b"]
    finally:
        h.stop(5)
        receiver.close()
    got = _ids_by_value(receiver)
    assert set(got) == set(expected)
    for value, records in got.items():
        for ids in records:
            assert ids == [expected[value].encode()], value
    # Lanes, and the event rows, went through the header path too.
    assert any(b"batch.completed" in v for v in got) and any(b'"expired"' in v for v in got)


def test_a_row_published_again_carries_the_same_message_id(pg_dsn, kafka_bootstrap, schema, topics):
    """Records written but reported failed are reset and republished after a forced remark (new
    marking ids); then the same rows come back as a restored backup or a promoted standby would
    hold them (same ids) and a new leader, of a new group, publishes them again."""
    topic = topics("data", partitions=PARTITIONS)
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'SET search_path TO "{schema}"')
        c.execute(
            "INSERT INTO outbox (topic, key, value) SELECT %s, ('k' || (i %% 9))::bytea, ('v' || i)::bytea "
            "FROM generate_series(1, 300) i",
            [topic],
        )
        c.commit()
        saved = c.execute("SELECT id, topic, key, value, created_at FROM outbox ORDER BY id").fetchall()
    expected = {v: i.encode() for v, i in _expected(pg_dsn, schema).items()}
    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    faults = FaultPlan(delivery_error_rate=0.2, seed=5)
    try:
        for round_ in (1, 2):
            cfg = make_config(pg_dsn, schema, kafka_bootstrap, harvester={"mark_batch": 50})
            h = Harvester(cfg, providers=faults.providers() if round_ == 1 else DEFAULT).start()
            try:
                assert wait_until(lambda: not _snapshot(pg_dsn, schema), 60), f"round {round_}: rows left"
                if round_ == 1:
                    assert h.publisher is not None and h.publisher.produced > len(saved)  # remarks sent rows again
            finally:
                h.stop(5)
            if round_ == 1:
                with psycopg.connect(pg_dsn) as c:  # the rows again, with their ids
                    with c.cursor() as cur:
                        cur.executemany(
                            f'INSERT INTO "{schema}".outbox (id, topic, key, value, created_at) '
                            "VALUES (%s, %s, %s, %s, %s)",
                            saved,
                        )
        assert wait_until(lambda: all(len(r) >= 2 for r in _ids_by_value(receiver).values()), 30)
    finally:
        receiver.close()
    got = _ids_by_value(receiver)
    assert set(got) == set(expected)
    assert sum(len(r) for r in got.values()) > 2 * len(expected)  # faulted records were published again too
    for value, records in got.items():
        assert all(ids == [expected[value]] for ids in records), value


class _NeverPurges:
    """The outbox store of a leader whose purges never reach the database (it dies before they do):
    its published rows stay, marked by it, for the next leader to publish again."""

    def __init__(self, store) -> None:
        self._store = store
        self.withheld = 0

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def purge(self, leader_id, ids) -> int:
        self.withheld += len(ids)
        return 0


def test_the_next_leader_of_the_group_publishes_a_row_again_with_the_same_message_id(
    pg_dsn, kafka_bootstrap, schema, topics
):
    topic, leader = topics("data", partitions=PARTITIONS), topics("leader", partitions=1)
    with psycopg.connect(pg_dsn) as c:
        c.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value) '
            "SELECT %s, ('k' || (i %% 7))::bytea, ('f' || i)::bytea FROM generate_series(1, 200) i",
            [topic],
        )
        c.commit()
    expected = {v: i.encode() for v, i in _expected(pg_dsn, schema).items()}
    assert all(i.count(b":") == 2 for i in expected.values())  # the form of rows created after the upgrade
    group = f"g-{uuid.uuid4().hex[:10]}"
    stores: list[_NeverPurges] = []

    def never_purges(store):
        stores.append(_NeverPurges(store))
        return stores[-1]

    receiver = Receiver(kafka_bootstrap, topic, PARTITIONS)
    cfg = make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=leader, group=group)
    first = Harvester(cfg, providers=Providers(store=never_purges)).start()
    second = None
    try:
        assert wait_until(lambda: set(expected) <= set(receiver.values()), 60), "the first leader published nothing"
        assert stores and stores[0].withheld >= len(expected) and len(_snapshot(pg_dsn, schema)) == len(expected)
        second = Harvester(cfg).start()  # the standby, in the same group
        time.sleep(1)
        first.stop(5)  # leaves the group: the standby leads and marks every row again from the head
        assert wait_until(lambda: not _snapshot(pg_dsn, schema), 60), "the next leader did not publish the rows"
        assert wait_until(lambda: all(len(r) >= 2 for r in _ids_by_value(receiver).values()), 30)
    finally:
        first.stop(5)
        if second is not None:
            second.stop(5)
        receiver.close()
    got = _ids_by_value(receiver)
    assert set(got) == set(expected)
    for value, records in got.items():
        assert len(records) >= 2 and all(ids == [expected[value]] for ids in records), value


def test_a_logical_restore_keeps_the_namespace_of_the_table_it_recreates(pg_dsn, schema):
    """A dump writes outbox_namespace.outbox as the table's name (regclass as text, as pg_dump's
    COPY does) and a restore resolves it to the table it has just created (a new oid)."""
    before = _namespace(pg_dsn, schema)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'SET search_path TO "{schema}"')
        with c.cursor().copy("COPY outbox_namespace TO STDOUT") as cp:
            dump = b"".join(bytes(chunk) for chunk in cp)
        assert dump.startswith(f"{schema}.outbox\t".encode()) or dump.startswith(b"outbox\t")
        old_oid = c.execute("SELECT 'outbox'::regclass::oid").fetchone()
        c.execute("DROP TABLE outbox_namespace")
        c.execute("DROP TABLE outbox CASCADE")
        c.execute(f'CREATE TABLE outbox (LIKE "{schema}".outbox_dead)')  # any table: a new oid
        assert c.execute("SELECT 'outbox'::regclass::oid").fetchone() != old_oid
        c.execute(
            "CREATE TABLE outbox_namespace (outbox regclass PRIMARY KEY, namespace uuid NOT NULL UNIQUE, "
            "created_at timestamptz NOT NULL, suffix_from timestamptz NOT NULL)"
        )
        with c.cursor().copy("COPY outbox_namespace FROM STDIN") as cp:
            cp.write(dump)
    assert _namespace(pg_dsn, schema) == before


def test_namespaces_are_per_table_stable_and_registered_once(pg_dsn, schema, other_schema):
    first, second = _namespace(pg_dsn, schema), _namespace(pg_dsn, other_schema)
    assert first != second and _namespace(pg_dsn, schema) == first
    # A table the migrations did not create gets one on first use: one for every caller at once.
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'CREATE TABLE "{schema}".outbox2 (LIKE "{schema}".outbox INCLUDING ALL)')
    got: list[uuid.UUID] = []
    start = threading.Barrier(6)

    def register() -> None:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            start.wait()
            got.append(message_ids.namespace(c, schema, "outbox2"))

    threads = [threading.Thread(target=register) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(got) == 6 and len(set(got)) == 1 and got[0] not in (first, second)
    # Registered after the upgrade: every row of it gets the new form; so do the rows of a fresh
    # install's outbox (no earlier version published any: tests/test_message_ids_reuse.py upgrades).
    assert got[0].suffix_from == first.suffix_from == message_ids.ALL_ROWS
    # Dropped and created anew, its ids start again: a new namespace, so no id comes twice.
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'DROP TABLE "{schema}".outbox2')
        c.execute(f'CREATE TABLE "{schema}".outbox2 (LIKE "{schema}".outbox INCLUDING ALL)')
    assert _namespace(pg_dsn, schema, "outbox2") != got[0]
    # A renamed table keeps its rows, hence its namespace.
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        renamed_from = message_ids.namespace(c, schema, "outbox2")
        c.execute(f'ALTER TABLE "{schema}".outbox2 RENAME TO outbox3')
        assert message_ids.namespace(c, schema, "outbox3") == renamed_from
        with pytest.raises(NamespaceUnavailable, match="outbox2"):
            message_ids.namespace(c, schema, "outbox2")
        c.execute(f'DROP TABLE "{schema}".outbox_namespace')
        with pytest.raises(NamespaceUnavailable, match="reaper migrate"):
            message_ids.namespace(c, schema, "outbox")


def test_a_namespace_read_in_a_transaction_leaves_it_open_and_unchanged(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        c.execute(f'CREATE TABLE "{schema}".outbox4 (LIKE "{schema}".outbox INCLUDING ALL)')
        ns = message_ids.namespace(c, schema, "outbox4")
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        c.rollback()  # the caller's rollback undoes the table and its registration alike
        c.execute(f'CREATE TABLE "{schema}".outbox4 (LIKE "{schema}".outbox INCLUDING ALL)')
        assert message_ids.namespace(c, schema, "outbox4") != ns
        c.rollback()


NAMESPACES = st.builds(
    message_ids.Namespace, st.uuids(), st.one_of(st.just(message_ids.ALL_ROWS), st.integers(-(2**62), 2**62))
)
ROW_IDS = st.integers(min_value=-(2**63), max_value=2**63 - 1)
# what the harvester gets: Postgres's int8 plus the epoch offset
CREATED = st.integers(min_value=message_ids.INT8_MIN, max_value=message_ids.INT8_MAX).map(
    lambda raw: raw + message_ids.PG_EPOCH_US
)


@given(NAMESPACES, ROW_IDS, CREATED, NAMESPACES, ROW_IDS, CREATED)
def test_message_ids_are_short_ascii_and_name_one_row_of_one_table(ns_a, id_a, at_a, ns_b, id_b, at_b):
    """Injective: two ids are equal only for one row (namespace, id and, from the cutover on, created_at);
    within one table, a row id used again by a row created later is another id."""
    a, b = message_ids.message_id(ns_a, id_a, at_a), message_ids.message_id(ns_b, id_b, at_b)
    for mid, ns, row, at in ((a, ns_a, id_a, at_a), (b, ns_b, id_b, at_b)):
        assert mid.isascii() and len(mid) <= message_ids.MESSAGE_ID_MAX
        new_form = at >= ns.suffix_from
        expected = f"{ns.prefix}{row}:{at}" if new_form else f"{ns.prefix}{row}"  # the harvester's way
        assert mid == expected == ns.message_id(row, at)
        parts = mid.split(":")
        assert uuid.UUID(parts[0]) == ns.uuid and int(parts[1]) == row
        assert parts[2:] == ([str(at)] if new_form else [])

    def names(ns, row, at):
        return (ns.uuid, row, at if at >= ns.suffix_from else None)

    assert (a == b) == (names(ns_a, id_a, at_a) == names(ns_b, id_b, at_b))
    if ns_a.uuid == ns_b.uuid and id_a == id_b and at_a != at_b and min(at_a, at_b) >= ns_a.suffix_from:
        assert a != b


@settings(max_examples=60, deadline=None)
@given(
    st.datetimes(
        min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31, 23, 59, 59, 999999), timezones=st.just(UTC)
    )
)
def test_created_at_in_microseconds_is_the_same_as_loaded_in_python_and_in_sql(pg_dsn, at):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        cur = c.cursor(binary=True)
        message_ids.load_timestamps_as_micros(cur.adapters)
        raw, exact = cur.execute(
            "SELECT %s::timestamptz, extract(epoch FROM %s::timestamptz) * 1000000", [at, at]
        ).fetchone()
    assert raw + message_ids.PG_EPOCH_US == message_ids.micros(at) == exact


def test_a_row_created_at_infinity_or_at_the_end_of_time_is_published_with_an_id(pg_dsn, schema):
    """Whatever an application wrote in created_at, the mark returns the row and its id is built:
    no row can stop the harvester."""
    times = ["-infinity", "infinity", "294276-12-31 23:59:59.999999+00", "4713-11-24 00:00:00+00 BC"]
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(
            f"INSERT INTO \"{schema}\".outbox (topic, value, created_at) SELECT 't', 'v', t::timestamptz "
            "FROM unnest(%s::text[]) AS t",
            [times],
        )
    _ns, rows = marked(pg_dsn, schema, 10)
    ids = [r[7] for r in rows]
    assert len(ids) == len(set(ids)) == len(times)
    assert all(i.isascii() and len(i) <= message_ids.MESSAGE_ID_MAX for i in ids)
    with pytest.raises(InvalidValue, match="created_at"):
        message_ids.message_id(message_ids.Namespace(uuid.uuid4()), 1, datetime(2026, 1, 1))  # naive


def test_a_row_without_created_at_is_published_with_an_id(pg_dsn, schema):
    """An outbox table of the application's own that lets created_at be NULL: the mark still
    returns an id for the row (as if created at -infinity), and the row after it goes too."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute(f'ALTER TABLE "{schema}".outbox ALTER COLUMN created_at DROP NOT NULL')
        c.execute(
            f"INSERT INTO \"{schema}\".outbox (topic, value, created_at) VALUES ('t', 'v', NULL), ('t', 'w', now())"
        )
    ns, rows = marked(pg_dsn, schema, 10)
    assert len(rows) == 2 and all(isinstance(r[7], str) for r in rows)
    assert rows[0][7] == ns.message_id(rows[0][0], message_ids.INT8_MIN + message_ids.PG_EPOCH_US)
    assert len({r[7] for r in rows}) == 2


class _Msg:
    def __init__(self, headers) -> None:
        self._headers = headers

    def headers(self):
        return self._headers


@given(st.lists(st.tuples(st.sampled_from(["origin", "message-id", "item-id"]), st.binary(max_size=120))))
def test_message_id_of_reads_the_last_header_and_refuses_what_no_harvester_writes(headers):
    ours = [v for k, v in headers if k == MESSAGE_ID_HEADER]
    if not ours:
        assert message_ids.message_id_of(_Msg(headers)) is None
        return
    last = ours[-1]
    if 1 <= len(last) <= message_ids.MESSAGE_ID_MAX and last.isascii():
        assert message_ids.message_id_of(_Msg(headers)) == last.decode()
    else:
        with pytest.raises(InvalidValue, match=MESSAGE_ID_HEADER):
            message_ids.message_id_of(_Msg(headers))


def test_an_upgrade_gives_the_outbox_its_namespace_without_rewriting_it(pg_dsn, tmp_path, kafka_bootstrap, topics):
    old_sql = sql_at(PREVIOUS, tmp_path)
    name = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, name, old_sql)
    topic = topics("data", partitions=1)
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute(f'SET search_path TO "{name}"')
            c.execute(
                "INSERT INTO outbox (topic, value) SELECT %s, ('old' || i)::bytea FROM generate_series(1, 50) i",
                [topic],
            )
            before = c.execute("SELECT pg_relation_filenode('outbox')").fetchone()
            assert c.execute("SELECT to_regclass('outbox_namespace')").fetchone() == (None,)
            assert schema_mod.migrate(pg_dsn, name)[0] == "0017_message_id.sql"
            assert c.execute("SELECT pg_relation_filenode('outbox')").fetchone() == before
            ids = {v: (i, at) for v, i, at in c.execute("SELECT value, id, created_at FROM outbox")}
        ns = _namespace(pg_dsn, name)
        receiver = Receiver(kafka_bootstrap, topic, 1)
        h = Harvester(make_config(pg_dsn, name, kafka_bootstrap)).start()
        try:
            assert wait_until(lambda: len(_ids_by_value(receiver)) == 50, 60)
        finally:
            h.stop(5)
            receiver.close()
        # The previous version published no message id: no row needs the short form.
        assert ns.suffix_from == message_ids.ALL_ROWS
        for value, records in _ids_by_value(receiver).items():
            i, at = ids[value]
            assert all(r == [f"{ns.uuid}:{i}:{message_ids.micros(at)}".encode()] for r in records)
    finally:
        drop_schema(pg_dsn, name)
