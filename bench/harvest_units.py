"""Harvest units for `python -m bench.harvest --only units`: one unit on one reaper against two
lanes on two reapers, in the same run, each as `reaper run` subprocesses.

Each configuration starts its reapers on an empty outbox, waits until every unit has a leader
(with two reapers: one unit each), then commits N rows in one COPY transaction and times commit
to empty outbox. CPU is the reapers' user + system time (from /proc) over the same span, per
record: it projects what more cores would give, since this shared 2-core machine also runs
Postgres and Kafka.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic

from tracker import schema as schema_mod

REPO = Path(__file__).resolve().parents[1]
VALUE = b"v" * 200
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _units_led(log: Path) -> set[int]:
    state: dict[int, str] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "neli ' in line:
            e = json.loads(line)
            if "unit" in e:
                state[e["unit"]] = e["event"][5:]
    return {u for u, s in state.items() if s == "leader"}


def _run(dsn: str, bootstrap: str, n: int, reapers: int, lanes: int, partitions: int) -> dict:
    schema = f"bench_units_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(dsn, schema)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic, leader = f"bench-units-{uuid.uuid4().hex[:8]}", f"bench-units-leader-{uuid.uuid4().hex[:8]}"
    for f in admin.create_topics(
        [
            NewTopic(topic, num_partitions=partitions, replication_factor=1),
            NewTopic(leader, num_partitions=lanes, replication_factor=1),
        ]
    ).values():
        f.result(30)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(
        {
            "REAPER_DATABASE__DSN": dsn,
            "REAPER_DATABASE__SCHEMA": schema,
            "REAPER_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
            "REAPER_HARVESTER__LEADER_TOPIC": leader,
            "REAPER_HARVESTER__LEADER_GROUP": f"g-{leader}",
            "REAPER_HARVESTER__LANES": str(lanes),
            "REAPER_HARVESTER__SESSION_TIMEOUT": "6",
            "REAPER_HARVESTER__HEARTBEAT_TIMEOUT": "2",
            "REAPER_ACKER__ENABLED": "false",
            "REAPER_SWEEPER__ENABLED": "false",
            "REAPER_METRICS__ENABLED": "false",
            "REAPER_LOGGING__FORMAT": "json",
        }
    )
    procs, logs = [], []
    try:
        for i in range(reapers):
            log = Path(f"/tmp/{schema}-{i}.log")
            out = open(log, "wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "harvester.cli", "run"],
                    cwd=REPO,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
            logs.append(log)
            if i == 0:  # the first leads everything; the others then take their share
                _wait(lambda: _units_led(logs[0]) == set(range(lanes)), 60, "the first reaper never led")
        _wait(lambda: all(len(_units_led(lg)) == lanes // reapers for lg in logs), 60, "units never spread")
        time.sleep(1)
        with psycopg.connect(dsn) as conn:
            with conn.cursor().copy(f'COPY "{schema}".outbox (topic, key, value) FROM STDIN') as cp:
                for i in range(n):
                    cp.write_row((topic, b"key-%d" % (i % 1000), VALUE))
            cpu0 = sum(_cpu_seconds(p.pid) for p in procs)
            conn.commit()
            started = time.perf_counter()
            conn.autocommit = True
            probe = f'SELECT EXISTS (SELECT 1 FROM "{schema}".outbox)'
            while conn.execute(probe).fetchone()[0]:
                time.sleep(0.02)
                if time.perf_counter() - started > 900:
                    raise RuntimeError("not drained after 900 s")
            elapsed = time.perf_counter() - started
            cpu = sum(_cpu_seconds(p.pid) for p in procs) - cpu0
        return {
            "reapers": reapers,
            "lanes": lanes,
            "records": n,
            "seconds": round(elapsed, 3),
            "records_per_s": round(n / elapsed),
            "reaper_cpu_s": round(cpu, 2),
            "reaper_cpu_us_per_record": round(cpu / n * 1e6, 2),
        }
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        for f in admin.delete_topics([topic, leader]).values():
            try:
                f.result(30)
            except Exception:
                pass


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.1)


def bench_units(dsn: str, bootstrap: str, n: int, rounds: int = 2, partitions: int = 8) -> dict:
    """Alternate one unit / two lanes `rounds` times; the ratio compares the medians."""
    one, two = [], []
    for _ in range(rounds):
        one.append(_run(dsn, bootstrap, n, reapers=1, lanes=1, partitions=partitions))
        two.append(_run(dsn, bootstrap, n, reapers=2, lanes=2, partitions=partitions))
    med = lambda runs: sorted(r["records_per_s"] for r in runs)[len(runs) // 2]  # noqa: E731
    return {"one_unit": one, "two_lanes_two_reapers": two, "ratio": round(med(two) / med(one), 3), "goal_ratio": 1.3}
