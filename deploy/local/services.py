#!/usr/bin/env python3
"""Local PostgreSQL, PgBouncer and Apache Kafka (single KRaft node) for development, tests and CI.

    python3 deploy/local/services.py up|down|status|env [--only postgres|kafka|pgbouncer|spark]
    python3 deploy/local/services.py fetch     # only resolve Kafka's jars into the machine's cache
    python3 deploy/local/services.py cluster up|down|status|...   # three brokers + a Postgres standby
                                               # (deploy/local/cluster.py), on ports of their own

Idempotent. Everything lives under <repo>/.local (git-ignored). PostgreSQL comes from Debian's
packages (apt-get installs it when missing); Kafka from its jars on Maven Central, resolved once by
`mvn dependency:copy-dependencies` on deploy/local/kafka/pom.xml. Standard library only, so it runs
before the project's virtualenv exists. Plus a Spark standalone master and two workers
(deploy/local/spark_cluster.py), from the venv's pyspark: `up` skips it while pyspark is not
installed (`make venv`; `--only spark` fails instead); OUTBOX_SPARK=0 leaves Spark out of `up`/`down`.

Downloads go through deploy/local/first_use.py (safe for several processes at once and for
interruption). Environment: OUTBOX_CACHE_DIR (per-machine cache, ~/.cache/outbox-reaper),
OUTBOX_KAFKA_LIB_CACHE (Kafka's jars, <cache>/kafka-lib), OUTBOX_LOCAL_DIR (state folder), OUTBOX_PG_PORT (55432), OUTBOX_KAFKA_PORT (59092),
OUTBOX_KAFKA_CONTROLLER_PORT (59093), OUTBOX_KAFKA_HEAP (512m), OUTBOX_SERVICES_TIMEOUT (90 s),
OUTBOX_PGBOUNCER_PORT (56432: PgBouncer in transaction pooling mode in front of the Postgres).

This module is the command line; the services are services_postgres.py, services_pgbouncer.py and
services_kafka.py, what they share (state folder, errors, logs, commands) services_base.py, all beside it.
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import subprocess
import sys

import first_use  # deploy/local/first_use.py: downloads safe under concurrency and interruption
import spark_cluster  # deploy/local/spark_cluster.py: Spark standalone master + 2 workers

# Every name the services' modules define is also read from here: the cluster's modules import this
# one as `base` (its jars, Java, Postgres binaries, errors and logs), and so may other scripts.
from services_base import (  # noqa: F401
    HERE,
    REPO,
    STATE,
    TIMEOUT,
    ServiceError,
    ensure_debian_packages,
    log,
    owned_pid,
    port_open,
    port_taken,
    run,
    tail,
)
from services_kafka import (  # noqa: F401
    CONTROLLER_PORT,
    KAFKA_DIR,
    KAFKA_HEAP,
    KAFKA_PORT,
    format_storage,
    java_cmd,
    kafka_down,
    kafka_jars,
    kafka_lib_cache,
    kafka_metadata_ok,
    kafka_pid,
    kafka_props,
    kafka_up,
    new_kafka_cluster_id,
)
from services_pgbouncer import (  # noqa: F401
    PGB_DIR,
    PGB_PORT,
    pgb_config,
    pgb_dsn,
    pgb_pid,
    pgb_ready,
    pgbouncer_down,
    pgbouncer_up,
)
from services_postgres import (  # noqa: F401
    PG_CONF_MARK,
    PG_DB,
    PG_DIR,
    PG_PORT,
    pg_bindir,
    pg_down,
    pg_dsn,
    pg_ready,
    pg_up,
    pg_user,
)


def status() -> int:
    bindir = None
    try:
        bindir = pg_bindir() if glob.glob("/usr/lib/postgresql/*/bin/initdb") else None
    except ServiceError:
        pass
    pg = bool(bindir) and pg_ready(bindir)
    kafka = kafka_metadata_ok()
    print(f"postgres: {'up ' + pg_dsn() if pg else 'down'}")
    print(f"kafka:    {'up 127.0.0.1:' + str(KAFKA_PORT) if kafka else 'down'}")
    # Not part of the exit status: callers (the demo) read it as "Postgres and Kafka are up".
    print(f"pgbouncer: {'up ' + pgb_dsn() if pg and pgb_ready() else 'down'}")
    _, spark_line = spark_cluster.status()
    print(f"spark:    {spark_line}")
    print(f"state:    {STATE}")
    return 0 if pg and kafka else 3  # Spark is optional here: callers (the demo) test for Postgres + Kafka


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["up", "down", "status", "env", "fetch", "cluster"])
    ap.add_argument("cluster_action", nargs="?", help="with `cluster`: see deploy/local/cluster.py")
    ap.add_argument("node", nargs="?", type=int, help="with `cluster` broker and Postgres actions: the node")
    ap.add_argument("--only", choices=["postgres", "kafka", "pgbouncer", "spark"])
    args = ap.parse_args(argv)
    if args.action == "cluster":
        import cluster  # deploy/local/cluster.py (imports this module: loaded only when asked for)

        if args.cluster_action not in cluster.ACTIONS:
            ap.error(f"cluster needs one of {', '.join(cluster.ACTIONS)}, got {args.cluster_action!r}")
        try:
            return cluster.main(args.cluster_action, args.node)
        except (cluster.base.ServiceError, first_use.FirstUseError, subprocess.CalledProcessError) as exc:
            print(f"[services] error: {exc}", file=sys.stderr)
            return 1
    if args.cluster_action is not None:
        ap.error(f"unexpected argument {args.cluster_action!r}")
    if args.action == "fetch":  # downloads only, nothing started: safe beside a running `up`
        try:
            print(f"KAFKA_LIB={kafka_jars()}")
        except (ServiceError, first_use.FirstUseError) as exc:
            print(f"[services] error: {exc}", file=sys.stderr)
            return 1
        return 0
    STATE.mkdir(parents=True, exist_ok=True)
    lock = open(STATE / "services.lock", "w")
    # Parallel test workers may all ask for `up` at once; one at a time does the work.
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        if args.action == "up":
            if args.only in (None, "postgres"):
                pg_up()
            if args.only in (None, "kafka"):
                kafka_up()
            if args.only in (None, "pgbouncer"):
                pgbouncer_up()
            spark_env = {}
            if args.only == "spark" or (args.only is None and spark_cluster.enabled()):
                if args.only is None and spark_cluster.spark_home() is None:
                    log("spark: skipped, pyspark is not installed yet (make venv)")
                else:
                    spark_env = spark_cluster.up(STATE)
            print(f"OUTBOX_TEST_DSN={pg_dsn()}")
            print(f"KAFKA_BOOTSTRAP=127.0.0.1:{KAFKA_PORT}")
            print(f"PGBOUNCER_DSN={pgb_dsn()}")
            print("".join(f"{k}={v}\n" for k, v in spark_env.items()), end="")
        elif args.action == "down":
            if args.only == "spark" or (args.only is None and spark_cluster.enabled()):
                spark_cluster.down(STATE)
            if args.only in (None, "pgbouncer"):
                pgbouncer_down()
            if args.only in (None, "kafka"):
                kafka_down()
            if args.only in (None, "postgres"):
                pg_down()
        elif args.action == "env":
            print(f"export OUTBOX_TEST_DSN={pg_dsn()}")
            print(f"export KAFKA_BOOTSTRAP=127.0.0.1:{KAFKA_PORT}")
            print(f"export PGBOUNCER_DSN={pgb_dsn()}")
        else:
            return status()
    except (
        ServiceError,
        first_use.FirstUseError,
        spark_cluster.SparkClusterError,
        subprocess.CalledProcessError,
    ) as exc:
        print(f"[services] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
