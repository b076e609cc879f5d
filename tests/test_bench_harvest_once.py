"""The CPU readings of bench/harvest_once.py: the local Postgres server's processes and the machine's,
read from /proc, checked against work the test makes a backend do on the real Postgres."""

from __future__ import annotations

import os
import time

import psycopg

from bench import harvest_once


def test_the_postmaster_is_found_and_a_busy_backend_counts_in_the_server_and_the_machine(pg_dsn: str) -> None:
    postmaster = harvest_once.postmaster_of(pg_dsn)
    assert postmaster is not None
    assert harvest_once._stat(postmaster)[0] == "postgres"
    with psycopg.connect(pg_dsn) as conn:
        backend = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        before, machine_before = harvest_once.server_cpu(postmaster), harvest_once.machine_cpu_s()
        assert postmaster in before and backend in before
        started = time.monotonic()
        # about half a second of one backend's CPU, whatever the machine's speed
        while time.monotonic() - started < 0.5:
            conn.execute("SELECT count(*) FROM generate_series(1, 200000)").fetchone()
        after, machine = harvest_once.server_cpu(postmaster), harvest_once.machine_cpu_s() - machine_before
    backend_s = after[backend] - before[backend]
    server_s = sum(v - before.get(pid, 0.0) for pid, v in after.items())
    # The backend worked most of that half second (a little went to the client and the round trips).
    assert backend_s >= 0.25, (backend_s, after, before)
    assert server_s >= backend_s
    # The machine counts the server's CPU and this test's own (ticks: a few of slack).
    assert machine + 5 / os.sysconf("SC_CLK_TCK") >= server_s, (machine, server_s)
    # Only the server's processes: not this test's.
    assert os.getpid() not in after


def test_a_server_not_on_this_machine_is_not_read() -> None:
    assert harvest_once.server_cpu(None) == {}
    # the pid of no process
    assert harvest_once._stat(2**22 + 1) is None
