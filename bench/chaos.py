"""Chaos on the production topology: `python -m bench.chaos [--seconds 300] [--lanes 3] [--seed N]`.
The last line of output is one JSON object.

On the local cluster (`deploy/local/services.py cluster up`: three Kafka brokers, replication
factor 3, min.insync.replicas 2; a Postgres primary with a synchronous standby), three reapers at
the default election settings publish and fold acks while writers commit keyed records, fan-outs
open, fill and close batches, and consumers ack every item through the ack topic, for `--seconds`.
Faults are drawn from a seeded random sequence, and are only kills and restarts: a broker killed
(SIGKILL) and started again, a broker restarted (SIGTERM, then started), a reaper killed (SIGKILL)
and one started in its place, a reaper stopped (SIGTERM) and one started in its place.

Reported, beside the load average at the start and the end:
  ledger         committed records lost, per-key order violations, committed batches without
                 exactly one completion event (all three must be 0)
  duplicates     records read more than once over records committed: the share of republished
                 copies the faults cost (goal: under 1%)
  fences         every "no heartbeat ... fencing" line of every reaper; `spontaneous` counts those
                 outside every fault's window (from the fault to its healing plus the session
                 timeout and 5 s) (goal: 0)
  rewinds        re-marks from the head ("force remark" lines of the reapers' logs)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from bench.pairs import load_average
from harvester import config as config_mod
from tests.support.cluster import Cluster, ClusterTopics, Consumers, FanOuts, check_completions
from tests.support.harness import Generator, Receiver, check_published, env_for, make_config, order_violations
from tests.support.reaper import ReaperProcess, stop_all
from tracker import schema as schema_mod

FENCE = "no heartbeat within heartbeat_timeout: fencing"
PARTITIONS = 6
GOALS = {"spontaneous_fences": 0, "duplicate_share": 0.01}
FAULTS = ("kill-broker", "restart-broker", "kill-reaper", "sigterm-reaper")
SHORT_WAIT = {"socket.timeout.ms": 2000}


def say(msg: str) -> None:
    print(f"[bench.chaos] {msg}", file=sys.stderr, flush=True)


@dataclass
class Window:
    kind: str
    target: str
    start: float  # wall clock (the reapers' log timestamps are wall clock)
    end: float = 0.0


@dataclass
class Run:
    cluster: Cluster
    env: dict[str, str]
    logs: Path
    reapers: list[ReaperProcess] = field(default_factory=list)
    retired: list[ReaperProcess] = field(default_factory=list)
    started: int = 0

    def start_reaper(self) -> ReaperProcess:
        self.started += 1
        r = ReaperProcess(self.env, self.logs / f"reaper-{self.started}.log")
        self.reapers.append(r)
        return r

    def replace(self, victim: ReaperProcess, sig: int) -> None:
        victim.signal(sig)
        try:
            victim.wait(60)
        except Exception:
            victim.kill()
        self.reapers.remove(victim)
        self.retired.append(victim)
        self.start_reaper()


def _wall(event: dict) -> float | None:
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def inject(run: Run, kind: str, rng: random.Random, session_timeout: float) -> Window:
    if kind in ("kill-broker", "restart-broker"):
        broker = rng.choice((1, 2, 3))
        window = Window(kind, f"broker {broker}", time.time())
        if kind == "kill-broker":
            run.cluster.kill_broker(broker)
            time.sleep(rng.uniform(3, 10))
        else:
            run.cluster.stop_broker(broker)
        run.cluster.start_broker(broker)
    else:
        victim = rng.choice(run.reapers)
        window = Window(kind, victim.log_path.stem, time.time())
        run.replace(victim, signal.SIGKILL if kind == "kill-reaper" else signal.SIGTERM)
    window.end = time.time() + session_timeout + 5.0
    return window


def measure(seconds: float, lanes: int, seed: int, rate: float) -> dict:
    rng = random.Random(seed)
    cluster = Cluster().up()
    topics = ClusterTopics(cluster.bootstrap)
    schema = f"chaos_{uuid.uuid4().hex[:10]}"
    schema_mod.migrate(cluster.dsn, schema)
    defaults = config_mod.HarvesterConfig()
    election = {k: getattr(defaults, k) for k in ("min_poll_interval", "heartbeat_timeout", "session_timeout")}
    election |= {"drain_timeout": defaults.drain_timeout, "idle_poll_interval": defaults.idle_poll_interval}
    topic, item_topic = topics("chaos-data", PARTITIONS), topics("chaos-items", PARTITIONS)
    ack_topic, completion_topic = topics("chaos-acks", PARTITIONS), topics("chaos-done", 1)
    cfg = make_config(
        cluster.dsn, schema, cluster.bootstrap, leader_topic=topics("chaos-leader", lanes), harvester=election
    )
    env = {
        **env_for(cfg),
        "REAPER_HARVESTER__LANES": str(lanes),
        "REAPER_ACKER__ENABLED": "true",
        "REAPER_ACKER__TOPIC": ack_topic,
        "REAPER_ACKER__GROUP": f"acker-{uuid.uuid4().hex[:8]}",
        "REAPER_SWEEPER__ENABLED": "true",
    }
    logs = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    run = Run(cluster, env, logs)
    data = Receiver(cluster.bootstrap, topic, PARTITIONS, conf=SHORT_WAIT)
    completions = Receiver(cluster.bootstrap, completion_topic, 1, conf=SHORT_WAIT)
    windows: list[Window] = []
    load = {"start": load_average()}
    gen = fan = consumers = None
    try:
        for _ in range(3):
            run.start_reaper()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(r.is_leader() for r in run.reapers):
            time.sleep(0.5)
        time.sleep(5)  # every reaper past its start-up checks
        gen = Generator(cluster.dsn, schema, topic, keys=60, per_txn=10).start(rate_per_s=rate)
        fan = FanOuts(cluster.dsn, schema, item_topic, completion_topic).start(interval=1.0)
        consumers = Consumers(cluster.bootstrap, item_topic, ack_topic).start()
        say(f"load running for {seconds:.0f} s, lanes {lanes}, seed {seed}; logs in {logs}")
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            time.sleep(rng.uniform(15, 30))
            if time.monotonic() - began >= seconds:
                break
            kind = rng.choice(FAULTS)
            at = time.monotonic() - began
            window = inject(run, kind, rng, defaults.session_timeout)
            windows.append(window)
            say(f"{at:6.1f}s {kind} {window.target} (healed after {time.monotonic() - began - at:.1f} s)")
            cluster.wait_in_sync([topic, item_topic], 90)
        gen.stop()
        fan.stop()
        lost = len(gen.committed - data.unique()) if not data.wait_for(gen.committed, 180) else 0
        violations = order_violations([(k, v) for k, v, _ in data.records])
        try:
            check_published(data, gen, timeout=5)
            check_completions(completions, fan, timeout=180)
            ledger_error = None
        except AssertionError as exc:
            ledger_error = str(exc)[:500]
        load["end"] = load_average()
    finally:
        for stoppable in (gen, fan, consumers):
            if stoppable is not None:
                try:
                    stoppable.stop()
                except BaseException:
                    pass
        stop_all(run.reapers)
        data.close()
        completions.close()
        cluster.up()  # every broker back
        topics.delete_all()
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')

    fences, spontaneous, rewinds = 0, [], 0
    for r in run.reapers + run.retired:
        for e in r.events():
            if e.get("event") == FENCE:
                fences += 1
                at = _wall(e)
                if at is not None and not any(w.start <= at <= w.end for w in windows):
                    spontaneous.append({"reaper": r.log_path.stem, "at": e.get("timestamp")})
            elif e.get("event") == "force remark":
                rewinds += 1
    committed = len(gen.committed) if gen else 0
    received = len(data.records)
    unique = len(data.unique())
    duplicate_share = (received - unique) / unique if unique else 0.0
    return {
        "bench": "chaos",
        "seconds": seconds,
        "lanes": lanes,
        "seed": seed,
        "offered_rate_per_s": rate,
        "faults": [{"kind": w.kind, "target": w.target, "at": round(w.start - windows[0].start, 1)} for w in windows]
        if windows
        else [],
        "records_committed": committed,
        "records_received": received,
        "ledger": {"lost": lost, "order_violations": len(violations), "error": ledger_error},
        "batches_committed": len(fan.committed) if fan else 0,
        "duplicate_share": round(duplicate_share, 5),
        "fences": fences,
        "spontaneous_fences": len(spontaneous),
        "spontaneous": spontaneous[:20],
        "rewind_lines": rewinds,
        "goals": GOALS,
        "met": {
            "spontaneous_fences": len(spontaneous) <= GOALS["spontaneous_fences"],
            "duplicate_share": duplicate_share < GOALS["duplicate_share"],
            "ledger": lost == 0 and not violations and ledger_error is None,
        },
        "load_average": load,
        "logs": str(logs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the load and the faults run")
    parser.add_argument("--lanes", type=int, default=1, help="harvest lanes of the outbox (default 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the fault sequence")
    parser.add_argument("--rate", type=float, default=400.0, help="records committed per second by the writers")
    args = parser.parse_args(argv)
    out = measure(args.seconds, args.lanes, args.seed, args.rate)
    print(json.dumps(out))
    return 0 if all(out["met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
