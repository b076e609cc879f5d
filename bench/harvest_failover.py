"""The failover part of bench.harvest: the publication gap (the largest pause between records
arriving at a consumer) across SIGTERM or SIGKILL of the leading reaper, one of two reaper
subprocesses publishing a steady load.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition

from bench.harvest import BOOTSTRAP, DSN, REPO, VALUE, Env


def _spawn(env: Env, name: str, session: float, heartbeat: float) -> tuple[subprocess.Popen, Path]:
    log = Path(f"/tmp/bench-harvest-{env.group}-{name}.log")
    full = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    full.update(
        {
            "REAPER_DATABASE__DSN": DSN,
            "REAPER_DATABASE__SCHEMA": env.schema,
            "REAPER_KAFKA__BOOTSTRAP_SERVERS": BOOTSTRAP,
            "REAPER_HARVESTER__LEADER_TOPIC": env.leader_topic,
            "REAPER_HARVESTER__LEADER_GROUP": env.group,
            "REAPER_HARVESTER__SESSION_TIMEOUT": str(session),
            "REAPER_HARVESTER__HEARTBEAT_TIMEOUT": str(heartbeat),
            "REAPER_ACKER__ENABLED": "false",
            "REAPER_SWEEPER__ENABLED": "false",
            "REAPER_METRICS__ENABLED": "false",
            "REAPER_LOGGING__FORMAT": "json",
        }
    )
    out = open(log, "wb")
    return subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "run"], cwd=REPO, env=full, stdout=out, stderr=subprocess.STDOUT
    ), log


def _is_leader(log: Path) -> bool:
    state = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event": "neli ' in line:
            state = json.loads(line)["event"][5:]
    return state == "leader"


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def bench_failover(sig: int, session: float, heartbeat: float, rate: float = 500.0) -> dict:
    """Gap in publication (largest pause between records arriving at a consumer) across the signal."""
    env = Env(partitions=1)
    procs = []
    stop = threading.Event()
    arrivals: list[float] = []
    try:
        a, alog = _spawn(env, "a", session, heartbeat)
        procs.append(a)
        if not _wait(lambda: _is_leader(alog), 60):
            raise RuntimeError("first reaper never led")
        b, blog = _spawn(env, "b", session, heartbeat)
        procs.append(b)
        time.sleep(3)
        consumer = Consumer(
            {"bootstrap.servers": BOOTSTRAP, "group.id": f"r-{uuid.uuid4().hex}", "enable.auto.commit": False}
        )
        consumer.assign([TopicPartition(env.topic, 0, 0)])

        def consume() -> None:
            while not stop.is_set():
                for m in consumer.consume(1000, 0.01):
                    if m.error() is None:
                        arrivals.append(time.monotonic())
            consumer.close()

        def write() -> None:
            with psycopg.connect(DSN) as conn:
                while not stop.is_set():
                    conn.execute(
                        f'INSERT INTO "{env.schema}".outbox (topic, key, value) VALUES (%s, %s, %s)',
                        [env.topic, b"k", VALUE],
                    )
                    conn.commit()
                    time.sleep(1 / rate)

        threads = [threading.Thread(target=consume, daemon=True), threading.Thread(target=write, daemon=True)]
        for t in threads:
            t.start()
        time.sleep(3)
        signalled = time.monotonic()
        a.send_signal(sig)
        a.wait(60)
        if not _wait(lambda: _is_leader(blog), session * 3 + 30):
            raise RuntimeError("standby never took over")
        time.sleep(3)
        stop.set()
        for t in threads:
            t.join(10)
        # Records the dying leader had already sent still arrive after the signal: the gap is the
        # longest pause between consecutive arrivals from just before the signal to the end.
        around = [t for t in arrivals if t >= signalled - 1]
        gap = max((y - x for x, y in zip(around, around[1:])), default=None)
        normal = [y - x for x, y in zip(arrivals, arrivals[1:]) if y < signalled - 1]
        return {
            "signal": signal.Signals(sig).name,
            "session_timeout_s": session,
            "heartbeat_timeout_s": heartbeat,
            "gap_s": round(gap, 3) if gap is not None else None,
            "normal_largest_pause_s": round(max(normal), 3) if normal else None,
        }
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
        env.drop()
