"""One harvest of a pre-filled outbox, timed, by whichever harvester code is on the path.

Run as a script by `python -m bench.harvest --baseline REF`, once with the working tree's code and
once with REF's, each in its own process:

    PYTHONPATH=TREE python -P bench/harvest_once.py --rows N [--set KEY=VALUE ...]

`-P` keeps this file's folder off sys.path, so `tracker` and `harvester` come from TREE alone. The
run migrates a fresh schema with TREE's own migrations, creates fresh topics, pre-fills the outbox
(`prefill`: the rows every side and the floor get), and times the harvester from the moment it
leads until every row is purged. The last line of output is one JSON object: records_per_s,
seconds, records, cpu_us_per_record (the process's CPU, every thread, over that window: steadier
than the rate on a busy machine), postgres_cpu_us_per_record (the database server's processes over
the same window: what the marks, purges, WAL and vacuum of each record cost there; null when the
server is not on this machine), machine_cpu_us_per_record (every process of the machine: reaper,
Postgres, Kafka and whatever else ran), and `code`, the folder the harvester was imported from.

This file imports nothing from bench/ (under REF's path, `bench` would be REF's), and it copes
with the harvester's API as it was before harvest units (`harvester.mpr`). An editable install of
the project (`pip install -e`) adds an import finder that serves every module missing from TREE
from the installed checkout instead (a module REF does not have yet would come from elsewhere):
`only_tree_on_path` removes it before anything of the project is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
from confluent_kafka.admin import AdminClient, NewTopic

VALUE = b"v" * 200
PARTITIONS = 8


def prefill(dsn: str, schema: str, topic: str, n: int, keys: int) -> None:
    """`n` rows of 200-byte values on `keys` keys, with item-id and batch-id headers, one COPY."""
    with psycopg.connect(dsn) as conn:
        with conn.cursor().copy(
            f'COPY "{schema}".outbox (topic, key, value, header_keys, header_values) FROM STDIN'
        ) as cp:
            for i in range(n):
                cp.write_row(
                    (
                        topic,
                        b"key-%d" % (i % keys),
                        VALUE,
                        ["item-id", "batch-id"],
                        [b"1:%d:%d" % (i // 8192, i % 8192), b"1"],
                    )
                )
        conn.commit()
        conn.autocommit = True
        conn.execute(f'VACUUM ANALYZE "{schema}".outbox')


def create_topics(bootstrap: str, partitions: int) -> tuple[AdminClient, str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic, leader_topic = f"bench-{uuid.uuid4().hex[:10]}", f"bench-leader-{uuid.uuid4().hex[:10]}"
    fs = admin.create_topics(
        [
            NewTopic(topic, num_partitions=partitions, replication_factor=1),
            NewTopic(leader_topic, num_partitions=1, replication_factor=1),
        ]
    )
    for f in fs.values():
        f.result(30)
    return admin, topic, leader_topic


def drop(dsn: str, schema: str, admin: AdminClient | None, topics: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    if admin is not None:
        for f in admin.delete_topics(topics).values():
            try:
                f.result(30)
            except Exception:
                pass


@contextlib.contextmanager
def prefilled(
    dsn: str, bootstrap: str, rows: int, keys: int, migrate: Callable[[str, str], object]
) -> Iterator[tuple[str, str, str]]:
    """A fresh schema (made by `migrate(dsn, schema)`), a fresh topic and leader topic, and the
    outbox pre-filled with `prefill`'s rows: (schema, topic, leader topic); all dropped afterwards."""
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = None
    topics: list[str] = []
    try:
        migrate(dsn, schema)
        admin, topic, leader_topic = create_topics(bootstrap, PARTITIONS)
        topics = [topic, leader_topic]
        prefill(dsn, schema, topic, rows, keys)
        yield schema, topic, leader_topic
    finally:
        drop(dsn, schema, admin, topics)


def only_tree_on_path() -> None:
    """Import the project's modules from sys.path only, not through an editable install's finder."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> tuple[str, int, float] | None:
    """(command name, parent pid, CPU seconds) of a process, from /proc; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return text[text.index("(") + 1 : text.rindex(")")], int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def postmaster_of(dsn: str) -> int | None:
    """The pid of the database server's postmaster when it runs on this machine, else None: the
    parent of this connection's backend, if /proc shows both as Postgres processes."""
    with psycopg.connect(dsn) as c:
        backend = c.execute("SELECT pg_backend_pid()").fetchone()[0]
        # read while connected: a closed connection's backend exits, and its /proc entry with it
        own = _stat(backend)
        if own is None or own[0] != "postgres":
            return None  # another machine (or a pid namespace of its own)
        parent = _stat(own[1])
    return own[1] if parent is not None and parent[0] == "postgres" else None


def server_cpu(postmaster: int | None) -> dict[int, float]:
    """CPU seconds so far of the postmaster and of each of its children (backends, autovacuum, WAL
    writer, checkpointer). Between two readings, a process that started counts whole; one that
    exited is lost (the reaper's connections stay open through the window)."""
    if postmaster is None:
        return {}
    out: dict[int, float] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            found = _stat(proc.name)
            if (
                found is not None
                and found[0] == "postgres"
                and (found[1] == postmaster or int(proc.name) == postmaster)
            ):
                out[int(proc.name)] = found[2]
    return out


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine since boot (/proc/stat: user, nice, system, irq and
    softirq; not idle, iowait, or time the hypervisor gave to others)."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(f) for f in Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / TICK


def _harvester_class():
    if importlib.util.find_spec("harvester.units") is not None:
        from harvester.units import Harvester
    else:  # before harvest units, the one harvester lived in harvester.mpr
        from harvester.mpr import Harvester  # type: ignore[no-redef]
    return Harvester


def harvest(dsn: str, bootstrap: str, rows: int, keys: int, overrides: dict[str, str]) -> dict:
    only_tree_on_path()
    import harvester
    from harvester import config as config_mod
    from harvester import logs
    from harvester import run as run_mod
    from tracker import schema as schema_mod

    logs.configure("json", "warning")
    # the process settings of `reaper run` (before tune_process, its garbage-collector settings)
    (getattr(run_mod, "tune_process", None) or run_mod.tune_gc)()
    Harvester = _harvester_class()
    schema = f"bench_{uuid.uuid4().hex[:10]}"
    admin = None
    topics: list[str] = []
    try:
        schema_mod.migrate(dsn, schema)  # this tree's own migrations
        admin, topic, leader_topic = create_topics(bootstrap, PARTITIONS)
        topics = [topic, leader_topic]
        prefill(dsn, schema, topic, rows, keys)
        cfg = config_mod.load(
            None,
            environ={},
            overrides={
                "database": {"dsn": dsn, "schema": schema},
                "kafka": {"bootstrap_servers": bootstrap},
                "harvester": {
                    "leader_topic": leader_topic,
                    "leader_group": f"bench-{uuid.uuid4().hex[:10]}",
                    "heartbeat_timeout": 2.0,
                    "session_timeout": 6.0,
                    **overrides,
                },
                "metrics": {"enabled": False},
            },
        )
        postmaster = postmaster_of(dsn)
        h = Harvester(cfg).start()
        try:
            while not h.leading:
                time.sleep(0.01)
            server0, machine0 = server_cpu(postmaster), machine_cpu_s()
            started, cpu = time.perf_counter(), _cpu_s()
            while h.publisher.purged_rows < rows:
                time.sleep(0.01)
                if time.perf_counter() - started > 900:
                    raise RuntimeError(f"only {h.publisher.purged_rows} of {rows} purged after 900 s")
            elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
            server1, machine = server_cpu(postmaster), machine_cpu_s() - machine0
        finally:
            h.stop(10)
        with psycopg.connect(dsn) as c:
            left = c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone()[0]
        if left:
            raise RuntimeError(f"{left} rows left in the outbox after all {rows} were counted as purged")
    finally:
        drop(dsn, schema, admin, topics)
    return {
        "records": rows,
        "seconds": round(elapsed, 3),
        "records_per_s": round(rows / elapsed),
        "cpu_us_per_record": round(cpu * 1e6 / rows, 2),
        "postgres_cpu_us_per_record": (
            round(sum(v - server0.get(pid, 0.0) for pid, v in server1.items()) * 1e6 / rows, 2)
            if postmaster is not None
            else None
        ),
        "machine_cpu_us_per_record": round(machine * 1e6 / rows, 2),
        "code": str(Path(harvester.__file__).resolve().parents[1]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a harvester.KEY")
    args = ap.parse_args(argv)
    overrides = dict(item.split("=", 1) for item in args.set)
    print(json.dumps(harvest(args.dsn, args.bootstrap, args.rows, args.keys, overrides)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
