"""A DSN whose options libpq refuses before it connects (`sslmode=bogus`, `port=notaport`) is a
configuration error on `database.dsn` (exit 2) for every command, at once, naming the option and
the value as written; a secret's value is never shown. A DSN libpq takes but cannot connect with
is still "database unreachable" (exit 3)."""

from __future__ import annotations

import json
import os

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.reaper import run_cli

from harvester import config
from harvester.dsn_options import dsn_refusal
from harvester.exit_codes import ExitCode

BAD = [
    ("host=127.0.0.1 port=55432 dbname=outbox user=postgres sslmode=bogus", "sslmode", "bogus"),
    ("postgresql://postgres:pw@127.0.0.1:notaport/outbox", "port", "notaport"),
    ("host=127.0.0.1 port=55432 user=postgres target_session_attrs=leader", "target_session_attrs", "leader"),
    ("host=a,b port=1,2,3 user=postgres", "port", "3 port numbers to 2 hosts"),
]


def _env(dsn: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(REAPER_DATABASE__DSN=dsn, REAPER_DATABASE__SCHEMA="dsn_never", **extra)
    return env


@pytest.mark.parametrize("dsn,option,value", BAD)
def test_every_command_calls_a_refused_option_a_configuration_error(dsn: str, option: str, value: str):
    for args in (["migrate", "--dry-run"], ["outbox", "status"], ["dead", "list"]):
        r = run_cli(args, _env(dsn))
        assert r.returncode == ExitCode.USAGE, (args, r.stderr)
        assert "'database.dsn'" in r.stderr and value in r.stderr and "unreachable" not in r.stderr, r.stderr


def test_reaper_run_reports_it_at_once_without_waiting_for_the_database(kafka_bootstrap):
    env = _env(
        BAD[1][0],
        REAPER_DATABASE__STARTUP_TIMEOUT="600",  # a wait would outlast run_cli's timeout
        REAPER_LOGGING__FORMAT="json",
        REAPER_KAFKA__BOOTSTRAP_SERVERS=kafka_bootstrap,
        REAPER_HARVESTER__ENABLED="false",
        REAPER_METRICS__ENABLED="false",
    )
    r = run_cli(["run"], env)
    events = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert r.returncode == ExitCode.USAGE, r.stderr[-1500:]
    assert not [e for e in events if e["event"] == "waiting for the database and Kafka"], events
    (cannot,) = [e for e in events if e["event"] == "cannot start"]
    assert "'database.dsn'" in cannot["error"] and 'value "notaport" for connection option "port"' in cannot["error"]


def test_a_dsn_libpq_takes_but_cannot_reach_is_still_unreachable():
    for dsn in ("postgresql://app:pw@127.0.0.1:1/outbox", "host=/nonexistent/dir port=5432", "host=db.invalid"):
        assert dsn_refusal(dsn) is None, dsn
    r = run_cli(["migrate", "--dry-run"], _env("host=/nonexistent/dir port=5432 sslmode=disable"))
    assert r.returncode == ExitCode.UNAVAILABLE and "database unreachable" in r.stderr, r.stderr


def test_a_secret_libpq_quotes_is_hidden():
    # a password with an unescaped "/" makes its first part the port: not shown, and why
    err = dsn_refusal("postgresql://app:Se/cret@db/x")
    assert err is not None and 'invalid integer value "***"' in str(err) and "%-encode" in str(err), err
    err = dsn_refusal("host=h password=HUNTER2 port=HUNTER2")
    assert err is not None and "HUNTER2" not in str(err) and '"port"' in str(err), err
    err = dsn_refusal("postgresql://app:Pa%zzSECRET@h/x")
    assert err is not None and "SECRET" not in str(err), err


@settings(max_examples=60, deadline=None)
@given(
    value=st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=20),
    secret=st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=6, max_size=20),
)
def test_a_refused_value_is_named_as_written_and_a_password_never(value: str, secret: str):
    modes = {"disable", "allow", "prefer", "require", "verify-ca", "verify-full"}
    err = dsn_refusal(f"host=h password=X{secret} sslpassword=Y{secret} sslmode={value}")
    if value in modes:
        assert err is None
        return
    assert err is not None and err.key == "database.dsn"
    assert f"X{secret}" not in str(err) and f"Y{secret}" not in str(err)
    assert f'"{value}"' in str(err) or value in (f"X{secret}", f"Y{secret}"), err


def test_redaction_keeps_the_option_an_integer_value_was_refused_for():
    shown = config.redact_dsn('connection is bad: invalid integer value "pw" for connection option "keepalives"')
    assert shown == 'connection is bad: invalid integer value "***" for connection option "keepalives"'


TCP_OPTIONS = ("keepalives", "keepalives_idle", "keepalives_interval", "keepalives_count", "tcp_user_timeout")
# what a person might write: numbers in and out of the kernel's ranges, signs, spaces, words, hex
_option_values = st.one_of(
    st.integers(min_value=-5, max_value=40_000).map(str),
    st.integers(min_value=2**31 - 2, max_value=2**33).map(str),
    st.sampled_from(["", "x", "1.5", "0x5", " 7 ", "+3", "-0", "1e3", "5s", "\t2", "٣"]),
)


@settings(max_examples=150, deadline=None)
@given(options=st.dictionaries(st.sampled_from(TCP_OPTIONS), _option_values, min_size=1, max_size=5))
def test_tcp_options_are_refused_exactly_when_libpq_refuses_them(pg_dsn: str, options: dict[str, str]):
    """libpq reads these only on a TCP socket, past the offline check's missing socket: the verdict
    is compared with libpq's own on a real TCP connection to the test database."""
    from psycopg.conninfo import make_conninfo

    dsn = make_conninfo(pg_dsn, **options)
    try:
        psycopg.connect(dsn, connect_timeout=10).close()
        libpq = None
    except psycopg.OperationalError as exc:
        libpq = str(exc).split("failed: ", 1)[-1].strip()
    refused = dsn_refusal(dsn)
    if libpq is None:
        assert refused is None, (options, refused)
    else:
        assert refused is not None and refused.key == "database.dsn", (options, libpq)
        assert libpq in str(refused), (options, libpq, str(refused))


def test_a_refused_tcp_option_is_a_configuration_error_not_unreachable(pg_dsn: str):
    from psycopg.conninfo import make_conninfo

    r = run_cli(["outbox", "status"], _env(make_conninfo(pg_dsn, keepalives="x")))
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert 'invalid integer value "x" for connection option "keepalives"' in r.stderr and "unreachable" not in r.stderr


def test_tcp_options_are_not_judged_for_a_unix_socket(monkeypatch: pytest.MonkeyPatch):
    # libpq never reads them there, so neither does the check
    monkeypatch.delenv("PGHOST", raising=False)
    monkeypatch.delenv("PGHOSTADDR", raising=False)
    for dsn in ("host=/nonexistent/dir keepalives=x", "port=5432 keepalives_idle=-1", "host=@abstract keepalives=x"):
        assert dsn_refusal(dsn) is None, dsn
    assert dsn_refusal("host=/nonexistent/dir,db.invalid keepalives=x") is not None
    monkeypatch.setenv("PGHOST", "db.invalid")  # what libpq would use for a DSN without a host
    assert dsn_refusal("port=5432 keepalives_idle=-1") is not None
