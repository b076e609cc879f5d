"""With harvester.outboxes, the dead rows of every outbox are reachable: `reaper outbox status` names,
per unit, the exact `reaper dead list` command for its outbox's dead rows, and `--outbox NAME` on
`dead list` and `dead requeue` reads that entry's table, in its own database and schema. Without
`--outbox` they read the `database` section's table, as before; a name the configuration does not
list is a usage error naming it."""

from __future__ import annotations

import json
import os
import shlex
import uuid

import psycopg
from psycopg import sql
from support.reaper import run_cli

from harvester.exit_codes import ExitCode

REFUSED = "postgresql://nobody@127.0.0.1:1/none?connect_timeout=2"


def _dead_row(pg_dsn: str, schema: str, row_id: int, topic: str) -> None:
    with psycopg.connect(pg_dsn) as c:
        c.execute(
            sql.SQL(
                "INSERT INTO {}.outbox_dead (id, created_at, topic, key, value, header_keys, header_values, "
                "leader_id, reason) VALUES (%s, now(), %s, 'k', 'x', '{{}}', '{{}}', gen_random_uuid(), "
                "'MSG_SIZE_TOO_LARGE')"
            ).format(sql.Identifier(schema)),
            [row_id, topic],
        )


def _env(pg_dsn: str, kafka_bootstrap: str, schema: str, outboxes: list[dict] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(
        REAPER_DATABASE__DSN=pg_dsn,
        REAPER_DATABASE__SCHEMA=schema,
        REAPER_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        REAPER_HARVESTER__LEADER_GROUP=f"g-{uuid.uuid4().hex[:8]}",
    )
    if outboxes is not None:
        env["REAPER_HARVESTER__OUTBOXES"] = json.dumps(outboxes)
    return env


def test_status_names_each_outboxs_dead_command_and_it_reaches_that_outboxs_rows(
    pg_dsn, kafka_bootstrap, schema, other_schema
):
    _dead_row(pg_dsn, schema, 40, "orders-topic")
    _dead_row(pg_dsn, other_schema, 41, "billing-topic")
    # billing in "another database": the same server under another DSN, so the command must use the entry's
    billing_dsn = f"{pg_dsn}{'&' if '?' in pg_dsn else '?'}application_name=billing"
    outboxes = [
        {"name": "orders", "schema": schema, "lanes": 2},
        {"name": "-billing", "schema": other_schema, "dsn": billing_dsn},
    ]
    env = _env(pg_dsn, kafka_bootstrap, schema, outboxes)

    st = run_cli(["outbox", "status", "--timeout", "3", "--json"], env)
    units = {u["name"]: u for u in json.loads(st.stdout)["units"]}
    assert units["orders.0"]["dead_command"] == units["orders.1"]["dead_command"] == "reaper dead list --outbox orders"
    assert units["-billing"]["dead_command"] == "reaper dead list --outbox=-billing", units
    text = run_cli(["outbox", "status", "--timeout", "3"], env).stdout
    assert "dead            1 rows (reaper dead list --outbox=-billing)" in text, text

    # The command status names, run as printed, lists that outbox's dead row (and only it).
    listed = run_cli([*shlex.split(units["-billing"]["dead_command"])[1:], "--json"], env)
    assert listed.returncode == ExitCode.OK, listed.stderr
    doc = json.loads(listed.stdout)
    assert (doc["matching"], [r["id"] for r in doc["rows"]]) == (1, [41]), doc
    orders = json.loads(run_cli(["dead", "list", "--outbox", "orders", "--json"], env).stdout)
    assert [r["id"] for r in orders["rows"]] == [40]
    # Without --outbox: the database section's table, as before.
    assert [r["id"] for r in json.loads(run_cli(["dead", "list", "--json"], env).stdout)["rows"]] == [40]

    requeued = run_cli(["dead", "requeue", "--outbox=-billing", "--id", "41", "--json"], env)
    assert requeued.returncode == ExitCode.OK, requeued.stderr
    assert json.loads(requeued.stdout)["dead_ids"] == [41]
    with psycopg.connect(pg_dsn) as c:
        o = sql.Identifier(other_schema)
        assert c.execute(sql.SQL("SELECT topic FROM {}.outbox").format(o)).fetchall() == [("billing-topic",)]
        assert c.execute(sql.SQL("SELECT count(*) FROM {}.outbox_dead").format(o)).fetchone() == (0,)
        logged = c.execute(sql.SQL("SELECT rows FROM {}.admin_log WHERE action = 'dead-requeue'").format(o))
        assert logged.fetchall() == [(1,)]
        assert c.execute(sql.SQL("SELECT count(*) FROM {}.outbox_dead").format(sql.Identifier(schema))).fetchone() == (
            1,
        )


def test_an_outbox_the_configuration_does_not_list_is_a_usage_error(pg_dsn, kafka_bootstrap, schema):
    env = _env(
        pg_dsn,
        kafka_bootstrap,
        schema,
        [{"name": "orders", "schema": schema}, {"name": "billing", "table": "billing_outbox"}],
    )
    for args in (["dead", "list", "--outbox", "Orders"], ["dead", "requeue", "--all", "--outbox", "nope"]):
        r = run_cli([*args, "--json"], env)
        assert r.returncode == ExitCode.USAGE, (r.returncode, r.stderr)
        error = json.loads(r.stdout)["error"]
        assert repr(args[-1]) in error and "orders, billing" in error, error
    # named before any database is touched: the database section's being unreachable changes nothing
    env["REAPER_DATABASE__DSN"] = REFUSED
    assert run_cli(["dead", "list", "--outbox", "nope"], env).returncode == ExitCode.USAGE


def test_an_outbox_entry_is_read_in_its_own_database(pg_dsn, kafka_bootstrap, schema):
    """The `database` section's database is down: that entry's dead rows are still listed."""
    _dead_row(pg_dsn, schema, 43, "t")
    env = _env(REFUSED, kafka_bootstrap, schema, [{"name": "orders", "schema": schema, "dsn": pg_dsn}])
    r = run_cli(["dead", "list", "--outbox", "orders", "--json"], env)
    assert r.returncode == ExitCode.OK and json.loads(r.stdout)["matching"] == 1, (r.stdout, r.stderr)
    assert run_cli(["dead", "list"], env).returncode == ExitCode.UNAVAILABLE


def test_without_outboxes_status_names_the_plain_command_and_default_is_its_name(pg_dsn, kafka_bootstrap, schema):
    _dead_row(pg_dsn, schema, 44, "t")
    env = _env(pg_dsn, kafka_bootstrap, schema, None)
    text = run_cli(["outbox", "status", "--timeout", "3"], env).stdout
    assert "dead            1 rows (reaper dead list)\n" in text, text
    for args in (["dead", "list", "--json"], ["dead", "list", "--outbox", "default", "--json"]):
        assert [r["id"] for r in json.loads(run_cli(args, env).stdout)["rows"]] == [44]
