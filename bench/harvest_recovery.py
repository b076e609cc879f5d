"""Recovery gaps for `python -m bench.harvest --only recovery`: publishing resumes how long after a
restarted Kafka answers a metadata request again, and after a restarted Postgres accepts
connections again (a reaper subprocess; PRIVATE service instances, never the shared ones).

The gap is measured by tests/support/recovery.resume_gap: from the moment the service answers to
the purge of the lowest row waiting then (a purge needs Kafka's acknowledgement and the database).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient, NewTopic

from tests.support.harness import Generator, env_for, make_config
from tests.support.private_services import PrivateServices
from tests.support.reaper import ReaperProcess
from tests.support.recovery import resume_gap
from tracker import schema as schema_mod


def _topics(bootstrap: str) -> tuple[str, str]:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic, leader = f"bench-rec-{uuid.uuid4().hex[:8]}", f"bench-rec-leader-{uuid.uuid4().hex[:8]}"
    for f in admin.create_topics(
        [
            NewTopic(topic, num_partitions=3, replication_factor=1),
            NewTopic(leader, num_partitions=1, replication_factor=1),
        ]
    ).values():
        f.result(30)
    return topic, leader


def _one(
    which: str,
    dsn: str,
    bootstrap: str,
    session: float,
    heartbeat: float,
    outage: float,
    log_dir: Path,
    pause: bool = False,
) -> dict:
    svc = PrivateServices()
    try:
        svc.up(only=which)
        if which == "postgres":
            dsn = svc.dsn
        else:
            bootstrap = svc.bootstrap
        schema = f"bench_rec_{uuid.uuid4().hex[:8]}"
        schema_mod.migrate(dsn, schema)
        topic, leader = _topics(bootstrap)
        cfg = make_config(
            dsn,
            schema,
            bootstrap,
            leader_topic=leader,
            harvester={
                "session_timeout": session,
                "heartbeat_timeout": heartbeat,
                "mark_batch": 500,
                "max_in_flight": 2000,
            },
        )
        gen = Generator(dsn, schema, topic, keys=30, per_txn=10).start(rate_per_s=500)
        reaper = ReaperProcess(env_for(cfg), log_dir / f"bench-recovery-{which}-{schema}.log")
        try:
            if not reaper.wait_leader(60):
                raise RuntimeError("the reaper never led")
            time.sleep(2)
            began = time.monotonic()
            if pause:  # a frozen broker (SIGSTOP), shorter than the session: no restart, no rejoin
                pid = int((svc.dir / "kafka" / "kafka.pid").read_text())
                os.kill(pid, signal.SIGSTOP)
                time.sleep(outage)
                began = time.monotonic()
                os.kill(pid, signal.SIGCONT)
            else:
                svc.down(only=which)
                time.sleep(outage)
                began = time.monotonic()
                svc.up(only=which)
            answered = time.monotonic()
            gap = resume_gap(dsn, schema, answered, timeout=120)
            return {
                "service": which,
                "how": "SIGSTOP/SIGCONT" if pause else "restart",
                "outage_s": outage,
                "start_s": round(answered - began, 3),
                "session_timeout_s": session,
                "heartbeat_timeout_s": heartbeat,
                "gap_s": round(gap, 3),
            }
        finally:
            gen.stop()
            reaper.terminate(30)
            reaper.kill()
    finally:
        svc.destroy()


def bench_recovery(dsn: str, bootstrap: str, log_dir: Path = Path("/tmp")) -> dict:
    """Both dependencies, with the bench's leader settings (session 6 s, heartbeat 2 s).

    A Kafka restart that outlasts the session (a JVM start here takes longer than 6 s) leaves the
    old group membership on the coordinator until its session expires; a broker frozen for less
    than the session (kafka_pause) measures reconnection alone."""
    return {
        "postgres": _one("postgres", dsn, bootstrap, 6.0, 2.0, 4.0, log_dir),
        "kafka_pause": _one("kafka", dsn, bootstrap, 6.0, 2.0, 3.0, log_dir, pause=True),
        "kafka": _one("kafka", dsn, bootstrap, 6.0, 2.0, 4.0, log_dir),
        # the default session (harvester.session_timeout = 15 s) outlasts the same restart: the
        # member keeps its id and its partition, and only reconnection is left
        "kafka_default_session": _one("kafka", dsn, bootstrap, 15.0, 2.0, 4.0, log_dir),
    }
