"""The suite's own defences against what a failed test leaves behind (tests/support/teardown.py):
a connection left in a transaction holding locks must not make a teardown, and every worker
behind it, wait for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from support.teardown import drop_schema

TESTS = Path(__file__).resolve().parent


def test_drop_schema_ends_a_connection_holding_locks_in_it(pg_dsn):
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as setup:
        setup.execute(
            f'CREATE SCHEMA "{name}"; CREATE TABLE "{name}".t (id int primary key); INSERT INTO "{name}".t VALUES (1)'
        )
    holder = psycopg.connect(pg_dsn)
    try:
        holder.execute(f'SELECT 1 FROM "{name}".t WHERE id = 1 FOR UPDATE')
        started = time.monotonic()
        drop_schema(pg_dsn, name)
        assert time.monotonic() - started < 30
        with pytest.raises(psycopg.OperationalError):
            holder.execute("SELECT 1")  # ended by the drop
    finally:
        holder.close()
    with psycopg.connect(pg_dsn, autocommit=True) as check:
        assert check.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", [name]).fetchone() == (0,)


def test_drop_schema_without_if_exists_names_a_missing_schema(pg_dsn):
    with pytest.raises(psycopg.errors.InvalidSchemaName):
        drop_schema(pg_dsn, f"t_{uuid.uuid4().hex[:12]}", if_exists=False)


INNER = """
import gc, os, psycopg

KEY = int(os.environ["INNER_LOCK_KEY"])

def test_a_fails_holding_a_lock():
    gc.disable()  # no collection by chance (the hook's own is explicit): what holds the connection decides
    holder = psycopg.connect(os.environ["INNER_DSN"])
    holder.execute("SELECT pg_advisory_xact_lock(%s)", [KEY])
    assert False, "fails with the lock held"

def test_b_takes_the_lock():
    with psycopg.connect(os.environ["INNER_DSN"], autocommit=True) as conn:
        conn.execute("SET lock_timeout = '3s'")
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [KEY])
"""


def _inner_run(tmp_path: Path, pg_dsn: str, with_hook: bool) -> str:
    (tmp_path / "test_inner.py").write_text(INNER)
    hook = "from support.teardown import release_failed_frames as pytest_runtest_makereport  # noqa: F401\n"
    (tmp_path / "conftest.py").write_text(hook if with_hook else "")
    env = {
        **os.environ,
        "PYTHONPATH": str(TESTS),
        "INNER_DSN": pg_dsn,
        "INNER_LOCK_KEY": str(uuid.uuid4().int % 2**62),
    }
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "test_inner.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return r.stdout + r.stderr


def test_a_failed_test_lets_go_of_its_connection_before_the_next_test(tmp_path, pg_dsn):
    out = _inner_run(tmp_path, pg_dsn, with_hook=True)
    assert "1 failed, 1 passed" in out, out
    # without the hook the failed test's traceback keeps its connection, and its lock, open
    out = _inner_run(tmp_path, pg_dsn, with_hook=False)
    assert "2 failed" in out and "LockNotAvailable" in out, out


SLOW = """
import time

def test_quick():
    pass

def test_slow():
    time.sleep(120)
"""


def test_an_interrupted_run_names_the_tests_still_running(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW)
    (tmp_path / "conftest.py").write_text(
        "from support.in_flight import pytest_keyboard_interrupt, pytest_runtest_logfinish, pytest_runtest_logstart"
        "  # noqa: F401\n"
    )
    out = tmp_path / "out.txt"
    with out.open("w") as f:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pytest",
                "-n",
                "2",
                "-p",
                "no:cacheprovider",
                "--rootdir",
                str(tmp_path),
                "test_slow.py",
            ],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(TESTS)},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while "." not in out.read_text().partition("workers [2 items]")[2]:  # test_quick passed
            assert time.monotonic() < deadline and run.poll() is None, out.read_text()
            time.sleep(0.2)
        time.sleep(1)
        os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C, or CI's time limit, sends
        run.wait(60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = out.read_text()
    assert "interrupted while these tests ran:\n  test_slow.py::test_slow" in text, text
    assert "test_quick" not in text.partition("interrupted while these tests ran:")[2], text
