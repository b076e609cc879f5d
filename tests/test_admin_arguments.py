"""The admin commands' text arguments are checked before anything touches the database: bytes that
are not UTF-8 on the command line (`--reason $'\\xff'`) are a usage error (exit 2) naming the
argument, not a driver or database error (exit 1). A usage error (or a configuration error) of an
admin command with --json also prints the JSON error document on stdout, as its other errors do."""

from __future__ import annotations

import argparse
import contextlib
import io
import json

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.harness import make_config
from test_admin import add_dead, counts, reaper

import tracker
from harvester import cli
from harvester.exit_codes import ExitCode

NOT_UTF8 = "\udcff"  # the byte 0xff on the command line, as Python decodes argv (surrogateescape)


@pytest.fixture
def cfg(pg_dsn, kafka_bootstrap, schema, topics):
    return make_config(pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader"))


def _parse(argv: list[str]) -> tuple[argparse.Namespace | None, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return cli._parser().parse_args(argv), ""
        except SystemExit as exc:
            assert exc.code == ExitCode.USAGE
            return None, err.getvalue()


# Any character but NUL, and lone surrogates (what bytes that are not UTF-8 become in argv).
CHARS = st.one_of(st.characters(exclude_characters="\x00"), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF))


@given(st.lists(CHARS, min_size=1, max_size=30).map("".join))  # st.text() would leave the surrogates out
def test_a_reason_is_taken_exactly_when_it_is_utf8_text(reason):
    args, err = _parse(["dead", "list", "--reason", reason])
    try:
        reason.encode("utf-8")
    except UnicodeEncodeError:
        assert args is None and "--reason must be UTF-8 text" in err, err
    else:
        assert args is not None and args.reason == reason, err


@pytest.mark.parametrize(
    "args",
    [
        ["dead", "list", "--reason", NOT_UTF8],
        ["dead", "list", "--reason", "ok" + NOT_UTF8, "--json"],
        ["dead", "requeue", "--reason", NOT_UTF8],
        ["acks", "requeue", "--reason", NOT_UTF8, "--dry-run"],
    ],
)
def test_a_reason_that_is_not_utf8_exits_2_naming_it_and_changes_nothing(cfg, pg_dsn, schema, args):
    add_dead(pg_dsn, schema, "t", 2, "x")
    before = counts(pg_dsn, schema)
    r = reaper(cfg, *args)
    assert r.returncode == ExitCode.USAGE, (r.returncode, r.stderr)
    assert "--reason must be UTF-8 text" in r.stderr, r.stderr
    assert counts(pg_dsn, schema) == before


def test_an_expiry_note_that_is_not_utf8_exits_2_and_leaves_the_batch_open(cfg, pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        b = tracker.Tracker(schema=schema).open_batch(c)
        c.commit()
    before = counts(pg_dsn, schema)
    r = reaper(cfg, "batch", "expire", str(b.id), "--note", NOT_UTF8)
    assert r.returncode == ExitCode.USAGE, (r.returncode, r.stderr)
    assert "--note must be UTF-8 text" in r.stderr, r.stderr
    assert counts(pg_dsn, schema) == before


# ------------------------------------------------------------------ usage errors with --json


@pytest.mark.parametrize(
    "argv, message",
    [
        (["dead", "list", "--json", "--limit", "-1"], "--limit must be a whole number from 1 to 10000"),
        (["dead", "list", "--js", "--limit", "0"], "--limit must be a whole number"),  # argparse's abbreviation
        (["dead", "requeue", "--json"], "one of the arguments --id --all --reason is required"),
        (["dead", "list", "--json", "--bogus"], "unrecognized arguments: --bogus"),
        (["dead", "--json"], "the following arguments are required"),
        (["batch", "expire", "abc", "--json"], "batch id must be a whole number"),
        (["dead", "list", "--reason", NOT_UTF8, "--json"], "--reason must be UTF-8 text"),
    ],
)
def test_a_usage_error_with_json_prints_the_json_error_document(capsys, argv, message):
    assert cli.main(argv) == ExitCode.USAGE
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["exit_code"] == ExitCode.USAGE and message in doc["error"], doc
    assert "usage: reaper" in err and message in err  # stderr as argparse writes it


@pytest.mark.parametrize("argv", [["dead", "list", "--limit", "-1"], ["migrate", "--json"], ["--json"]])
def test_a_usage_error_without_an_admin_json_prints_nothing_on_stdout(capsys, argv):
    assert cli.main(argv) == ExitCode.USAGE
    out, err = capsys.readouterr()
    assert out == "" and "error:" in err


def test_a_configuration_error_with_json_prints_the_json_error_document(cfg):
    r = reaper(cfg, "dead", "list", "--json", extra={"REAPER_DATABASE__POOL_SIZE": "0"})
    assert r.returncode == ExitCode.USAGE and "database.pool_size" in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert doc["exit_code"] == ExitCode.USAGE and "database.pool_size" in doc["error"]
    r = reaper(cfg, "dead", "list", "--json", "--limit", "-1")  # the real entry point, not cli.main
    assert r.returncode == ExitCode.USAGE and json.loads(r.stdout)["exit_code"] == ExitCode.USAGE
