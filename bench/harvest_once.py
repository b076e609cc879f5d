"""One harvest of a pre-filled outbox, timed, by whichever harvester code is on the path.

Run as a script by `python -m bench.harvest --baseline REF`, once with the working tree's code and
once with REF's, each in its own process:

    PYTHONPATH=TREE python -P bench/harvest_once.py --rows N [--set KEY=VALUE ...]

`-P` keeps this file's folder off sys.path, so `tracker` and `harvester` come from TREE alone. The
run migrates a fresh schema with TREE's own migrations, creates fresh topics, pre-fills the outbox
(`prefill`: the rows every side and the floor get), and times the harvester from the moment it
leads until every row is purged. The last line of output is one JSON object: records_per_s,
seconds, records, cpu_us_per_record (the process's CPU, every thread, over that window: steadier
than the rate on a busy machine), and `code`, the folder the harvester was imported from.

This file imports nothing from bench/ (under REF's path, `bench` would be REF's), and it copes
with the harvester's API as it was before harvest units (`harvester.mpr`). An editable install of
the project (`pip install -e`) adds an import finder that serves every module missing from TREE
from the installed checkout instead (a module REF does not have yet would come from elsewhere):
`only_tree_on_path` removes it before anything of the project is imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import sys
import time
import uuid
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


def only_tree_on_path() -> None:
    """Import the project's modules from sys.path only, not through an editable install's finder."""
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


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
        h = Harvester(cfg).start()
        try:
            while not h.leading:
                time.sleep(0.01)
            started, cpu = time.perf_counter(), _cpu_s()
            while h.publisher.purged_rows < rows:
                time.sleep(0.01)
                if time.perf_counter() - started > 900:
                    raise RuntimeError(f"only {h.publisher.purged_rows} of {rows} purged after 900 s")
            elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu
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
