"""An outbox table of the application's own (database.outbox_table other than `outbox`) that does
not exist yet is not blamed on a missing migration (`reaper migrate` never makes it): the commands
and `reaper run` say to create it like the outbox, and its `_dead` table like `outbox_dead`; once
made that way, the commands use them."""

from __future__ import annotations

import json
import os

import psycopg
from support.reaper import run_cli

from harvester.exit_codes import ExitCode


def _env(pg_dsn: str, schema: str, kafka_bootstrap: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(
        REAPER_DATABASE__DSN=pg_dsn,
        REAPER_DATABASE__SCHEMA=schema,
        REAPER_DATABASE__OUTBOX_TABLE="orders_outbox",
        REAPER_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
    )
    env.update(extra)
    return env


def test_a_missing_table_of_the_application_says_how_to_make_it(pg_dsn, schema, kafka_bootstrap):
    env = _env(pg_dsn, schema, kafka_bootstrap)
    assert run_cli(["migrate"], env).returncode == ExitCode.OK  # makes `outbox`, not `orders_outbox`
    r = run_cli(["outbox", "status", "--timeout", "5"], env)
    assert r.returncode == ExitCode.UNAVAILABLE, r.stderr
    assert "run `reaper migrate`" not in r.stderr, r.stderr
    assert f"CREATE TABLE {schema}.orders_outbox (LIKE {schema}.outbox INCLUDING ALL)" in r.stderr, r.stderr

    run = run_cli(
        ["run"],
        {
            **env,
            "REAPER_LOGGING__FORMAT": "json",
            "REAPER_METRICS__ENABLED": "false",
            "REAPER_HARVESTER__ENABLED": "false",
        },
    )
    events = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    (cannot,) = [e for e in events if e["event"] == "cannot start"]
    assert run.returncode == ExitCode.UNAVAILABLE and "run `reaper migrate`" not in cannot["error"], cannot
    assert f"LIKE {schema}.outbox INCLUDING ALL" in cannot["error"], cannot

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {schema}.orders_outbox (LIKE {schema}.outbox INCLUDING ALL)")
    r = run_cli(["outbox", "status", "--timeout", "5"], env)
    assert f"CREATE TABLE {schema}.orders_outbox_dead (LIKE {schema}.outbox_dead INCLUDING ALL)" in r.stderr, r.stderr

    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # as docs/howto/running.md says
        conn.execute(f"CREATE TABLE {schema}.orders_outbox_dead (LIKE {schema}.outbox_dead INCLUDING ALL)")
    r = run_cli(["outbox", "status", "--timeout", "5"], env)
    assert r.returncode == ExitCode.OK and f"{schema}.orders_outbox" in r.stdout, r.stdout + r.stderr


def test_a_missing_migrated_table_still_asks_for_the_migration(pg_dsn, kafka_bootstrap):
    env = _env(pg_dsn, "never_migrated_here", kafka_bootstrap, REAPER_DATABASE__OUTBOX_TABLE="outbox")
    r = run_cli(["outbox", "status", "--timeout", "5"], env)
    assert r.returncode == ExitCode.UNAVAILABLE and "run `reaper migrate`" in r.stderr, r.stderr
