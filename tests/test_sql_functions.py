"""The SQL functions of sql/R__sql_api.sql (any language, inside the caller's transaction).

From psql (a real subprocess) and psycopg: the documented walkthroughs, typed errors that name the
value and change nothing, the caller's search path and temporary tables, racing calls that complete
a batch exactly once. That they agree with the Python API: test_sql_functions_agree.py.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid

import psycopg
import pytest
from psycopg import sql

import tracker


def _psql(dsn: str, script: str, check: bool = True) -> subprocess.CompletedProcess:
    exe = shutil.which("psql")
    if exe is None:
        pytest.fail("psql is not installed (Debian: apt-get install postgresql-client)")
    out = subprocess.run(
        [exe, dsn, "-X", "-q", "-A", "-t", "-v", "VERBOSITY=verbose"],
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check:
        assert out.returncode == 0, out.stderr
    return out


def _counts(conn: psycopg.Connection, schema: str) -> tuple[int, int, int]:
    return conn.execute(
        sql.SQL("SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM {}), (SELECT count(*) FROM {})").format(
            sql.Identifier(schema, "batch"), sql.Identifier(schema, "batch_group"), sql.Identifier(schema, "outbox")
        )
    ).fetchone()


def test_psql_walkthrough_commits_and_completes(pg_dsn, schema):
    s = f'"{schema}"'
    out = _psql(
        pg_dsn,
        f"""
\\set ON_ERROR_STOP 1
BEGIN;
SELECT {s}.open_batch(user_key => 'catalog-42', completion_topic => 'done-topic') AS b \\gset
SELECT batch_id, group_id, start, upto FROM {s}.enqueue(:b, 'process-item', ARRAY['x', 'y', 'z']::bytea[]);
SELECT batch_id || ':' || group_id || ':' || start || ':' || upto FROM {s}.add_items(:b, 8190);
SELECT {s}.close_batch(:b);
COMMIT;
SELECT acked || '/' || duplicates || '/' || completed::text FROM {s}.ack(ARRAY[:b || ':0:0-8191', :b || ':1:0', :b || ':0:5']);
SELECT state || '/' || total || '/' || pending FROM {s}.batch_status(:b);
SELECT topic || '/' || (convert_from(value, 'UTF8')::json->>'user_key') FROM {s}.outbox WHERE topic = 'done-topic';
""",
    )
    lines = out.stdout.split()
    assert lines[0] == "1|0|0|3"  # -A: columns joined by |
    assert lines[1] == "1:0:3:8192" and lines[2] == "1:1:0:1"
    assert lines[3] == "f"  # closed, not complete
    assert lines[4] == "8193/1/{1}"  # the 8,193 items acked, '1:0:5' a duplicate; batch 1 completed
    assert lines[5] == "complete/8193/0"
    assert lines[6] == "done-topic/catalog-42"
    with psycopg.connect(pg_dsn) as conn:
        assert _counts(conn, schema) == (1, 2, 4)  # 3 messages + 1 completion event


def test_psql_documented_insert_writes_one_message_per_item(pg_dsn, schema):
    """The insert-it-yourself form of docs/howto/sql.md: add_items, then one INSERT over the group rows."""
    s = f'"{schema}"'
    _psql(
        pg_dsn,
        f"""
\\set ON_ERROR_STOP 1
BEGIN;
SELECT {s}.open_batch() AS b \\gset
SELECT count(*) FROM {s}.add_items(:b, 8000);
INSERT INTO {s}.outbox (topic, key, value, header_keys, header_values)
SELECT 'process-item', NULL, convert_to(format('{{"n": %s}}', i), 'UTF8'),
       ARRAY['item-id', 'batch-id'],
       ARRAY[convert_to(h.batch_id || ':' || h.group_id || ':' || i, 'UTF8'), convert_to(h.batch_id::text, 'UTF8')]
FROM {s}.add_items(:b, 1000) h, generate_series(h.start, h.upto - 1) i;
COMMIT;
""",
    )
    with psycopg.connect(pg_dsn) as conn:
        ids = [
            r[0]
            for r in conn.execute(
                sql.SQL("SELECT convert_from(header_values[1], 'UTF8') FROM {} ORDER BY id").format(
                    sql.Identifier(schema, "outbox")
                )
            ).fetchall()
        ]
        assert ids == [f"1:0:{i}" for i in range(8000, 8192)] + [f"1:1:{i}" for i in range(808)]
        assert tracker.Tracker(schema=schema).ack(conn, ids).acked == 1000


def test_psql_rolled_back_transaction_leaves_nothing(pg_dsn, schema):
    s = f'"{schema}"'
    out = _psql(
        pg_dsn,
        f"""
\\set ON_ERROR_STOP 1
BEGIN;
SELECT {s}.open_batch('gone') AS b \\gset
SELECT count(*) FROM {s}.enqueue(:b, 't', ARRAY['1', '2']::bytea[]);
SELECT {s}.close_batch(:b);
SELECT acked FROM {s}.ack(ARRAY[:b || ':0:0-1']);
SELECT state FROM {s}.batch_status(:b);
ROLLBACK;
""",
    )
    # one group handle; closed; 2 acked (claims: the batch completes when they are settled, at commit)
    assert out.stdout.split() == ["1", "f", "2", "closed"]
    with psycopg.connect(pg_dsn) as conn:
        assert _counts(conn, schema) == (0, 0, 0)


@pytest.mark.parametrize(
    "call, code, named",
    [
        ("SELECT * FROM {s}.ack(ARRAY['1:0:0', 'x:0:1'])", "RT001", "x:0:1"),
        ("SELECT * FROM {s}.ack(ARRAY['999:0:1'])", "RT002", "999:0:1"),
        ("SELECT * FROM {s}.ack(ARRAY['1:7:3'])", "RT003", "1:7:3"),
        ("SELECT * FROM {s}.ack(ARRAY['1:0:0-4'])", "RT004", "1:0:0-4"),  # a run is named as written
        ("SELECT * FROM {s}.ack(ARRAY['1:0:8192'])", "RT004", "1:0:8192"),
        ("SELECT * FROM {s}.add_items(1, 5)", "RT005", "1"),
        ("SELECT * FROM {s}.batch_status(12345)", "RT002", "12345"),
        ("SELECT * FROM {s}.close_batch(12345)", "RT002", "12345"),
        ("SELECT * FROM {s}.add_items(1, -1)", "RT007", "-1"),
        ("SELECT * FROM {s}.enqueue(1, '', ARRAY['a']::bytea[])", "RT007", "topic"),
        (
            "SELECT * FROM {s}.enqueue(1, 't', ARRAY['a']::bytea[], header_keys => ARRAY['item-id'], "
            "header_values => ARRAY['x']::bytea[])",
            "RT007",
            "header_keys",
        ),
    ],
)
def test_psql_errors_are_typed_name_the_value_and_change_nothing(pg_dsn, schema, call, code, named):
    s = f'"{schema}"'
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # batch 1: 4 items in group 0, closed
        conn.execute(sql.SQL("SELECT {}.open_batch()").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SELECT * FROM {}.add_items(1, 4)").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SELECT {}.close_batch(1)").format(sql.Identifier(schema)))
        before = conn.execute(
            sql.SQL("SELECT pending, state, last_activity_at FROM {}.batch").format(sql.Identifier(schema))
        ).fetchall()
        counts = _counts(conn, schema)
    out = _psql(pg_dsn, "BEGIN;\n" + call.format(s=s) + ";\nCOMMIT;\n", check=False)
    assert f"ERROR:  {code}: " in out.stderr, out.stderr
    assert repr(named) in out.stderr or f" {named}" in out.stderr, out.stderr
    assert f"DETAIL:  {named}" in out.stderr, out.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert (
            conn.execute(
                sql.SQL("SELECT pending, state, last_activity_at FROM {}.batch").format(sql.Identifier(schema))
            ).fetchall()
            == before
        )
        assert _counts(conn, schema) == counts


def test_functions_ignore_the_callers_search_path(pg_dsn, schema):
    """A caller whose search_path holds tables named like ours still reaches the migrated schema."""
    decoy = f"d_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        tracker.schema.migrate(conn, decoy)
        try:
            conn.execute(sql.SQL("SET search_path TO {}, public").format(sql.Identifier(decoy)))
            b = conn.execute(sql.SQL("SELECT {}.open_batch('k')").format(sql.Identifier(schema))).fetchone()[0]
            conn.execute(sql.SQL("SELECT * FROM {}.add_items(%s, 3)").format(sql.Identifier(schema)), [b])
            assert conn.execute("SELECT count(*) FROM batch").fetchone()[0] == 0  # the decoy schema's
            assert _counts(conn, schema)[:2] == (1, 1)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(decoy)))


def test_a_callers_temporary_tables_cannot_stand_in_for_ours(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("CREATE TEMP TABLE batch (id bigserial, user_key text, completion_topic text)")
        conn.execute("CREATE TEMP TABLE outbox (topic text)")
        b = conn.execute(sql.SQL("SELECT {}.open_batch('mine')").format(sql.Identifier(schema))).fetchone()[0]
        assert conn.execute(sql.SQL("SELECT {}.close_batch(%s)").format(sql.Identifier(schema)), [b]).fetchone()[0]
        assert conn.execute("SELECT count(*) FROM pg_temp.batch").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM pg_temp.outbox").fetchone()[0] == 0
        assert _counts(conn, schema) == (1, 0, 1)  # the batch and its completion event, in the schema
        path = conn.execute(
            "SELECT proconfig FROM pg_proc WHERE oid = %s::regprocedure",
            [f'"{schema}".open_batch(text, text, bigint, bigint, float8)'],
        ).fetchone()[0]
        assert path == [f"search_path={schema}, pg_catalog, pg_temp", "jit=off"]


def test_failed_call_inside_a_savepoint_leaves_the_transaction_usable(conn, schema):
    s = sql.Identifier(schema)
    b = conn.execute(sql.SQL("SELECT {}.open_batch()").format(s)).fetchone()[0]
    conn.execute(sql.SQL("SELECT * FROM {}.add_items(%s, 10)").format(s), [b])
    with pytest.raises(psycopg.Error) as info:
        with conn.transaction():  # a savepoint inside the open transaction
            conn.execute(sql.SQL("SELECT * FROM {}.ack(ARRAY[%s, %s])").format(s), [f"{b}:0:1", f"{b}:0:10"])
    assert info.value.sqlstate == "RT004" and info.value.diag.message_detail == f"{b}:0:10"
    assert conn.execute(sql.SQL("SELECT pending FROM {}.batch_status(%s)").format(s), [b]).fetchone()[0] == 10
    got = conn.execute(sql.SQL("SELECT * FROM {}.ack(ARRAY[%s])").format(s), [f"{b}:0:1"]).fetchone()
    assert got == (1, 0, [])
    conn.rollback()
    assert _counts(conn, schema) == (0, 0, 0)


def test_enqueue_keys_headers_and_tombstones(conn, schema):
    s = sql.Identifier(schema)
    b = conn.execute(sql.SQL("SELECT {}.open_batch()").format(s)).fetchone()[0]
    conn.execute(sql.SQL("SELECT * FROM {}.add_items(%s, 8190)").format(s), [b])  # leaves 2 bits in group 0
    handles = conn.execute(
        sql.SQL(
            "SELECT * FROM {}.enqueue(%s, 'tp', %s, key => 'k'::bytea, header_keys => ARRAY['h'], "
            "header_values => ARRAY['\\xff00'::bytea], keys => %s)"
        ).format(s),
        [b, [b"a", None, b"c", b"d"], [None, b"own", None, None]],
    ).fetchall()
    assert handles == [(b, 0, 8190, 8192), (b, 1, 0, 2)]
    rows = conn.execute(
        sql.SQL("SELECT key, value, header_keys, header_values FROM {} ORDER BY id").format(
            sql.Identifier(schema, "outbox")
        )
    ).fetchall()
    assert rows == [
        (b"k", b"a", ["item-id", "batch-id", "h"], [f"{b}:0:8190".encode(), str(b).encode(), b"\xff\x00"]),
        (b"own", None, ["item-id", "batch-id", "h"], [f"{b}:0:8191".encode(), str(b).encode(), b"\xff\x00"]),
        (b"k", b"c", ["item-id", "batch-id", "h"], [f"{b}:1:0".encode(), str(b).encode(), b"\xff\x00"]),
        (b"k", b"d", ["item-id", "batch-id", "h"], [f"{b}:1:1".encode(), str(b).encode(), b"\xff\x00"]),
    ]


# -- Races: completion exactly once -----------------------------------------------------------------


def _race(dsn: str, calls: list[str]) -> None:
    """Run each SQL text in its own connection and transaction, all started together."""
    import threading

    barrier = threading.Barrier(len(calls))
    errors: list[BaseException] = []

    def run(text: str) -> None:
        try:
            with psycopg.connect(dsn) as conn:
                barrier.wait(timeout=30)
                conn.execute(text)
                conn.commit()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors


@pytest.mark.parametrize("kind", ["two final acks", "close against the last ack"])
def test_racing_calls_complete_the_batch_exactly_once(pg_dsn, schema, kind):
    s = f'"{schema}"'
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for _ in range(10):
            b = conn.execute(f"SELECT {s}.open_batch()").fetchone()[0]
            if kind == "two final acks":
                conn.execute(f"SELECT * FROM {s}.add_items(%s, 2)", [b])
                conn.execute(f"SELECT {s}.close_batch(%s)", [b])
                calls = [f"SELECT * FROM {s}.ack(ARRAY['{b}:0:0'])", f"SELECT * FROM {s}.ack(ARRAY['{b}:0:1'])"]
            else:
                conn.execute(f"SELECT * FROM {s}.add_items(%s, 1)", [b])
                calls = [f"SELECT * FROM {s}.ack(ARRAY['{b}:0:0'])", f"SELECT {s}.close_batch({b})"]
            _race(pg_dsn, calls)
            # What the reaper's settler does within its interval: a commit whose settle found the
            # batch row held by the other call leaves its claims for the next settle.
            with psycopg.connect(pg_dsn) as settler:
                tracker.settle(settler, schema=schema, registry=None)
                settler.commit()
            state, pending = conn.execute(f"SELECT state, pending FROM {s}.batch_status(%s)", [b]).fetchone()
            events = conn.execute(
                f"SELECT count(*) FROM {s}.outbox WHERE header_keys = ARRAY['batch-id'] "
                "AND key = convert_to(%s::text, 'UTF8')",
                [b],
            ).fetchone()[0]
            assert (state, pending, events) == ("complete", 0, 1)


def test_psql_outcomes_threshold_child_failures_and_the_completion_events(pg_dsn, schema):
    """From psql: a parent with a threshold and a child, failures recorded by id (`fail`) and by
    pre-folded mask (`fail_masks`), read back a page at a time (`failures`), one event per batch."""
    s = f'"{schema}"'
    out = _psql(
        pg_dsn,
        f"""
\\set ON_ERROR_STOP 1
BEGIN;
SELECT {s}.open_batch(user_key => 'psql-parent', completion_topic => 'psql-done', tolerated_failures => 2) AS p \\gset
SELECT {s}.open_batch(user_key => 'psql-child', completion_topic => 'psql-done', parent => :p) AS c \\gset
SELECT count(*) FROM {s}.add_items(:p, 4);
SELECT count(*) FROM {s}.add_items(:c, 2);
SELECT {s}.close_batch(:c, 'psql-done');
SELECT {s}.close_batch(:p, 'psql-done');
COMMIT;
SELECT 'fail ' || failed || '/' || duplicates || '/' || completed::text FROM {s}.fail(ARRAY[:p || ':0:0', :p || ':0:0'], 'timeout', 'psql-done');
SELECT 'masks ' || failed || '/' || completed::text FROM {s}.fail_masks(ARRAY[:c]::int8[], ARRAY[0]::int8[], ARRAY['C0'], 'bad row', 'psql-done');
SELECT 'child ' || state || '/' || outcome || '/' || failed || '/' || succeeded FROM {s}.batch_status(:c);
SELECT 'parent ' || state || '/' || coalesce(outcome, '-') || '/' || children_open FROM {s}.batch_status(:p);
SELECT 'ack ' || acked || '/' || completed::text FROM {s}.ack(ARRAY[:p || ':0:1-3'], 'psql-done');
SELECT 'parent ' || state || '/' || outcome || '/' || failed || '/' || succeeded || '/' || children_open FROM {s}.batch_status(:p);
SELECT 'page ' || item_id || '=' || reason FROM {s}.failures(:c, NULL, 1);
SELECT 'page ' || item_id || '=' || reason FROM {s}.failures(:c, :c || ':0:0', 1);
SELECT 'page ' || count(*) FROM {s}.failures(:c, :c || ':0:1', 1);
SELECT 'page ' || item_id || '=' || reason FROM {s}.failures(:p);
SELECT 'event ' || (v->>'batch_id') || '/' || (v->>'outcome') || '/' || (v->>'failed') || '/' || (v->'rollup'->>'failed')
  FROM (SELECT convert_from(value, 'UTF8')::json AS v, id FROM {s}.outbox WHERE topic = 'psql-done') e ORDER BY id;
""",
    )
    p, c = 1, 2
    assert out.stdout.splitlines()[2:] == [
        "f",  # the child: closed, nothing recorded
        "f",  # the parent: closed, waiting for its items and its child
        "fail 1/1/{}",  # one failed; the same id again a duplicate; 1 failure of 2 tolerated
        f"masks 2/{{{c}}}",  # both of the child's items: it finishes, failed
        "child complete/failed/2/0",
        "parent closed/-/1",  # the finished child is folded in by the parent's next write
        "ack 3/{}",  # the parent's last items, claimed: with its child folded in, it finishes at the commit
        "parent complete/failed/1/3/0",
        f"page {c}:0:0=bad row",
        f"page {c}:0:1=bad row",
        "page 0",
        f"page {p}:0:0=timeout",
        f"event {c}/failed/2/2",
        f"event {p}/failed/1/3",
    ], out.stdout
