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


def _stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from the text of a /proc/<pid>/stat."""
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def _cpu_seconds(pid: int) -> float:
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def _machine_jiffies() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the whole machine since boot, from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def _service_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of every Postgres process and of the Kafka broker (a java process)."""
    out = {"postgres": 0.0, "kafka": 0.0}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        group = "postgres" if comm == "postgres" else "kafka" if comm == "java" else None
        if group:
            out[group] += _stat_cpu_seconds(stat)
    return out


def _units_led(log: Path) -> set[int]:
    state: dict[int, str] = {}
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "neli ' in line:
            e = json.loads(line)
            if "leader_partition" in e:
                state[e["leader_partition"]] = e["event"][5:]
    return {u for u, s in state.items() if s == "leader"}


def _run(dsn: str, bootstrap: str, n: int, reapers: int, lanes: int, partitions: int, lane_index: bool = True) -> dict:
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
            "REAPER_HARVESTER__LANE_INDEX": "true" if lane_index else "false",
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
            services0, machine0 = _service_cpu_seconds(), _machine_jiffies()
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
            services1, machine1 = _service_cpu_seconds(), _machine_jiffies()
        total, idle = machine1[0] - machine0[0], machine1[1] - machine0[1]
        return {
            "reapers": reapers,
            "lanes": lanes,
            "lane_index": lane_index and lanes > 1,
            "records": n,
            "seconds": round(elapsed, 3),
            "records_per_s": round(n / elapsed),
            "reaper_cpu_s": round(cpu, 2),
            "reaper_cpu_us_per_record": round(cpu / n * 1e6, 2),
            # The rest of the machine's work per record (the services are shared with everything
            # else here, so these include whatever else ran), and how busy the machine was.
            "postgres_cpu_us_per_record": round((services1["postgres"] - services0["postgres"]) / n * 1e6, 2),
            "kafka_cpu_us_per_record": round((services1["kafka"] - services0["kafka"]) / n * 1e6, 2),
            "machine_busy": round(1 - idle / max(1, total), 3),
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
    """Alternate one unit / two lanes / two lanes without the lane index `rounds` times; the ratios
    compare the medians."""
    one, two, unindexed = [], [], []
    for _ in range(rounds):
        one.append(_run(dsn, bootstrap, n, reapers=1, lanes=1, partitions=partitions))
        two.append(_run(dsn, bootstrap, n, reapers=2, lanes=2, partitions=partitions))
        unindexed.append(_run(dsn, bootstrap, n, reapers=2, lanes=2, partitions=partitions, lane_index=False))
    med = lambda runs: sorted(r["records_per_s"] for r in runs)[len(runs) // 2]  # noqa: E731
    busy = sorted(r["machine_busy"] for r in one)[len(one) // 2]
    return {
        "one_unit": one,
        "two_lanes_two_reapers": two,
        "two_lanes_without_lane_index": unindexed,
        "ratio": round(med(two) / med(one), 3),
        "ratio_without_lane_index": round(med(unindexed) / med(one), 3),
        "goal_ratio": 1.3,
        # However the work is split, this machine cannot do more than all of its cores: with one
        # unit keeping it `busy`, no split can beat 1 / busy times one unit's rate here.
        "ceiling_ratio_on_this_machine": round(1 / max(busy, 0.01), 3),
    }


def bench_lane_index(dsn: str, rows: int = 200_000, keys: int = 1000, mark: int = 5000, repeat: int = 5) -> dict:
    """What the lane index (harvester.lane_index) costs and saves, in Postgres alone: the time of a
    `mark`-row lane mark along the primary key and through the index, by lane count, over a backlog
    of `rows`; and the time to COPY the backlog in (the application's insert) with and without it."""
    from harvester.lane_index import LaneIndex
    from harvester.publishing.outbox_sql import FOREVER, OutboxStore, make_pool

    schema = f"bench_lane_index_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(dsn, schema)
    pool = make_pool(dsn, 2)
    out: dict = {"rows": rows, "mark_rows": mark, "by_lanes": {}}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:

            def copy_in() -> float:
                conn.execute(f'TRUNCATE "{schema}".outbox')
                started = time.perf_counter()
                with (
                    conn.transaction(),
                    conn.cursor().copy(f'COPY "{schema}".outbox (topic, key, value) FROM STDIN') as cp,
                ):
                    for i in range(rows):
                        cp.write_row(("t", b"key-%d" % (i % keys), VALUE))
                return time.perf_counter() - started

            plain = min(copy_in() for _ in range(2))
            for lanes in (2, 4, 8):
                index = LaneIndex(schema, "outbox", lanes)
                while index.build_step(conn) != "valid":
                    pass
                conn.execute(f'VACUUM ANALYZE "{schema}".outbox')
                timings = {}
                for indexed in (False, True):
                    store = OutboxStore(pool, schema, lane=lanes - 1, lanes=lanes)
                    store.use_lane_index(indexed)
                    samples = []
                    for _ in range(repeat):
                        started = time.perf_counter()
                        got = store.mark(uuid.uuid4(), mark, until=FOREVER)
                        samples.append(time.perf_counter() - started)
                        assert len(got) == mark
                    timings["index" if indexed else "primary_key"] = round(sorted(samples)[repeat // 2] * 1000, 1)
                    conn.execute(f'UPDATE "{schema}".outbox SET leader_id = NULL WHERE leader_id IS NOT NULL')
                    conn.execute(f'VACUUM "{schema}".outbox')
                out["by_lanes"][lanes] = {
                    "mark_ms": timings,
                    "speedup": round(timings["primary_key"] / timings["index"], 2),
                }
                if lanes == 2:
                    indexed_copy = min(copy_in() for _ in range(2))
                    out["insert_us_per_row"] = {
                        "without_index": round(plain / rows * 1e6, 2),
                        "with_lane_index": round(indexed_copy / rows * 1e6, 2),
                    }
                conn.execute(f'DROP INDEX "{schema}"."{index.name}"')
    finally:
        pool.close()
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return out
