"""Publication on a production topology: `python -m bench.cluster [--quick] [--skip-faults]`.
The last line of output is one JSON object.

On the local cluster (`deploy/local/services.py cluster up`: three Kafka brokers, replication
factor 3, min.insync.replicas 2; a Postgres primary with a synchronous standby) beside the
single-node services (OUTBOX_TEST_DSN / KAFKA_BOOTSTRAP, else the local ones), in one run:

  latency   throughput of a pre-filled outbox, and commit -> Kafka acknowledgement p50/p99 at
            2,000 records/s offered (the idempotent producer: acks=all), on the single broker and
            on the three brokers, both from the single-node Postgres (only Kafka differs)
  faults    one reaper (default settings) publishing a steady load on the cluster; per fault the
            publication gap: from the fault (the signal killing or pausing a broker, a stopped
            one shut down) to the first record committed after it being read back,
            on the partition that waited longest (a fault that stalls one partition shows
            there); for a broker fault also split (split_s) into Kafka's failover (until the
            other brokers' metadata names a live leader for every partition of the outbox and
            leader topics and for the election group's coordinator) and the reaper's share
            (from then to that record read back); for a promotion, from the new primary
            accepting writes to the first record
            committed on it being read back. Goals: broker loss <= 3 s, promotion <= 5 s.
            --rounds N repeats each broker fault N times (each round names its victim; rounds_s
            lists every round, a fault's figure is its worst). Each broker fault's gap is also
            counted to when Kafka appended that record (the topic's LogAppendTime), apart from
            the bench's own consumer finding the new leaders (appended_s, gap_appended; the
            probe's kafka_writable_appended). After each heal the run waits until the Kafka
            nodes use no more CPU than in the steady load before the first fault (at most 60 s;
            a restarted JVM is busy for a while), and each round records the cores the nodes
            used just before it (kafka_cores_before, beside kafka_cores_steady), the 1-minute
            load, and how long the settling took (settled_after).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bench.cluster_gaps import PARTITIONS, QUIET, FailoverWatch, Probe, Reader, Writer, gap_after, split
from bench.cluster_quiet import Quiet, cores
from bench.harvest_latency import stamping
from bench.harvest_once import prefill
from bench.pairs import load_average
from harvester import config as config_mod
from harvester.units import Harvester
from tests.support.cluster import Cluster
from tests.support.reaper import ReaperProcess, stop_all
from tracker import schema as schema_mod

GOALS = {"broker_loss_s": 3.0, "promotion_s": 5.0}


def say(msg: str) -> None:
    print(f"[bench.cluster] {msg}", file=sys.stderr, flush=True)


def topics(bootstrap: str, replication: int, *partitions: int) -> list[str]:
    admin = AdminClient({"bootstrap.servers": bootstrap, **QUIET})
    names = [f"bench-cl-{uuid.uuid4().hex[:10]}" for _ in partitions]
    # each record carries the time its leader appended it: when Kafka took it, apart from when
    # the bench's own consumer, which has a failover of its own to make, read it back
    appended = {"message.timestamp.type": "LogAppendTime"}
    fs = admin.create_topics(
        [
            NewTopic(n, num_partitions=p, replication_factor=replication, config=appended)
            for n, p in zip(names, partitions)
        ]
    )
    for f in fs.values():
        f.result(60)
    return names


def harvester_config(dsn: str, bootstrap: str, schema: str, topic_leader: str) -> config_mod.Config:
    return config_mod.load(
        None,
        environ={},
        overrides={
            "database": {"dsn": dsn, "schema": schema},
            "kafka": {"bootstrap_servers": bootstrap},
            "harvester": {"leader_topic": topic_leader, "leader_group": f"bench-{uuid.uuid4().hex[:8]}"},
            "metrics": {"enabled": False},
        },
    )


def throughput_and_latency(dsn: str, bootstrap: str, replication: int, rows: int, seconds: float) -> dict:
    """Drain `rows` pre-filled rows (records/s), then offer 2,000 records/s for `seconds`: commit ->
    delivery report p50/p99 (the harvester's settle queue stamps each acknowledged row)."""
    schema = f"bench_cl_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(dsn, schema)
    topic, leader = topics(bootstrap, replication, PARTITIONS, 1)
    prefill(dsn, schema, topic, rows, 1000)
    cfg = harvester_config(dsn, bootstrap, schema, leader)
    h = Harvester(cfg).start()
    try:
        while not h.leading:
            time.sleep(0.01)
        started = time.perf_counter()
        while h.publisher.purged_rows < rows:
            time.sleep(0.01)
        drain = rows / (time.perf_counter() - started)
    finally:
        h.stop(10)
    # A second leadership on the emptied outbox: its settle queue is stamped before anything is produced.
    h = Harvester(cfg).start()
    acked: dict[int, float] = {}
    try:
        while not h.leading:
            time.sleep(0.01)
        h.publisher.settler.reports = stamping(h.publisher.settler.reports, acked)
        committed: dict[int, float] = {}
        rate, per_txn = 2000.0, 10
        ins = (
            f'INSERT INTO "{schema}".outbox (topic, key, value) '
            "SELECT %s, convert_to('key-' || (g %% 1000), 'UTF8'), %s FROM generate_series(1, %s) g RETURNING id"
        )
        with psycopg.connect(dsn) as conn:
            started = time.monotonic()
            sent = 0
            while time.monotonic() - started < seconds:
                if sent >= (time.monotonic() - started) * rate:
                    time.sleep(0.0005)
                    continue
                ids = [r[0] for r in conn.execute(ins, [topic, b"v" * 200, per_txn]).fetchall()]
                conn.commit()
                t = time.time()
                committed.update((i, t) for i in ids)
                sent += per_txn
            elapsed = time.monotonic() - started
        deadline = time.monotonic() + 30
        while len(acked) < len(committed) and time.monotonic() < deadline:
            time.sleep(0.05)
        lat = sorted(acked[i] - committed[i] for i in committed if i in acked)
        q = statistics.quantiles(lat, n=100)
        return {
            "drain_records_per_s": round(drain),
            "offered_per_s": rate,
            "acknowledged_per_s": round(len(lat) / elapsed),
            "records": len(committed),
            "p50_ms": round(q[49] * 1000, 2),
            "p99_ms": round(q[98] * 1000, 2),
        }
    finally:
        h.stop(10)
        with psycopg.connect(dsn, autocommit=True) as c:
            c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


FAULTS = ("kill_leader", "kill_controller", "cut_off", "rolling", "promotion")


def faults(
    cluster: Cluster, log_dir: Path, pause: float, which: tuple[str, ...], extra_env: dict[str, str], rounds: int = 1
) -> dict:
    schema = f"bench_cf_{uuid.uuid4().hex[:8]}"
    schema_mod.migrate(cluster.dsn, schema)
    topic, leader = topics(cluster.bootstrap, 3, PARTITIONS, 1)
    env = {
        "REAPER_DATABASE__DSN": cluster.dsn,
        "REAPER_DATABASE__SCHEMA": schema,
        "REAPER_KAFKA__BOOTSTRAP_SERVERS": cluster.bootstrap,
        "REAPER_HARVESTER__LEADER_TOPIC": leader,
        "REAPER_HARVESTER__LEADER_GROUP": f"bench-{uuid.uuid4().hex[:8]}",
        **extra_env,
    }
    writer, reader = Writer(cluster.dsn, schema, topic), Reader(cluster.bootstrap, topic)
    probe = Probe(cluster.bootstrap, topic)
    out: dict = {"split": {}, "rounds": {}, "appended": {}}
    reaper: ReaperProcess | None = None
    try:
        reaper = ReaperProcess(env, log_dir / "reaper.log")
        if not reaper.wait_leader(120):
            raise RuntimeError(f"the reaper never led: {reaper.log_path.read_text()[-2000:]}")
        reader.start()
        writer.start()
        probe.start()
        time.sleep(pause)
        quiet = Quiet()
        out["kafka_cores_steady"] = quiet.measure_baseline()

        def broker_fault(name: str, choose: Callable[[], int], fault, heal) -> None:
            # how busy the Kafka nodes were just before the fault, and the machine (1-minute load);
            # the victim chosen after that reading, so that it is who leads when the fault comes
            busy = {"kafka_cores_before": cores(), "load_1m": round(os.getloadavg()[0], 2)}
            victim = choose()
            watch = FailoverWatch(cluster.bootstrap, victim, [topic, leader], env["REAPER_HARVESTER__LEADER_GROUP"])
            # counted from the signal (the fault command reports when it sent it), not from when
            # the command returned
            at = fault(victim) or time.monotonic()
            watch.start()
            gap = gap_after(writer, reader, at)
            writable = gap_after(probe, reader, at, timeout=10)
            watch.join(10)
            parts = split(gap, at, watch, writable)
            # the same two, counted to when Kafka appended the first records rather than to when
            # the bench's consumer read them back
            parts["gap_appended"] = gap_after(writer, reader, at, timeout=5, appended=True)
            parts["kafka_writable_appended"] = gap_after(probe, reader, at, timeout=5, appended=True)
            # the signal's wall-clock time, to line the round up with the reaper's and brokers' logs
            signal_at = datetime.fromtimestamp(time.time() - (time.monotonic() - at), UTC).isoformat()
            out["rounds"].setdefault(name, []).append({"victim": victim, "signal_at": signal_at, **parts, **busy})
            say(
                f"{name} round {len(out['rounds'][name])} (kafka node {victim}, signal at {signal_at}): "
                f"publication gap {gap} s: {parts}"
            )
            time.sleep(pause)
            heal(victim)
            cluster.wait_in_sync([topic, leader], 120)
            time.sleep(pause)
            # the healed node's JVM starting up is load the next fault must not meet (bench.cluster_quiet)
            settled = quiet.settle()
            out["rounds"][name][-1]["settled_after"] = settled
            if not settled["quiet"]:
                say(f"the Kafka nodes did not settle within {quiet.timeout:.0f} s of the heal: {settled}")

        def partition_leader() -> int:
            leaders = cluster.topic_leaders(topic)
            return max(set(leaders.values()), key=list(leaders.values()).count)

        for _ in range(rounds):
            if "kill_leader" in which:
                broker_fault("kill_partition_leader_s", partition_leader, cluster.kill_broker, cluster.start_broker)
            if "kill_controller" in which:
                broker_fault("kill_controller_s", cluster.controller, cluster.kill_broker, cluster.start_broker)
            if "cut_off" in which:
                broker_fault(
                    "cut_off_partition_leader_s", partition_leader, cluster.pause_broker, cluster.resume_broker
                )
        for name, got in out["rounds"].items():  # a fault's figure: its worst round
            gaps = [r["gap"] for r in got]
            out[name] = None if None in gaps else max(gaps)
            appended = [r["gap_appended"] for r in got]
            out["appended"][name] = None if None in appended else max(appended)
            out["split"][name] = max(got, key=lambda r: r["gap"] if r["gap"] is not None else float("inf"))
        rolling = []
        for n in (1, 2, 3) if "rolling" in which else ():
            cluster.stop_broker(n)  # returns once the broker has shut down (its leaders moved first)
            at = time.monotonic()
            rolling.append(gap_after(writer, reader, at))
            cluster.start_broker(n)
            cluster.wait_in_sync([topic, leader], 120)
            quiet.settle()  # the restarted broker's start-up, before the next one stops
        if rolling:
            out["rolling_restart_worst_s"] = max((g for g in rolling if g is not None), default=None)
            say(f"rolling restart: gaps {rolling}")
        if "promotion" in which:
            promotion(cluster, writer, reader, out)
            time.sleep(pause)
        writer.stop.set()
        probe.stop.set()
        writer.join(10)
        probe.join(10)
        time.sleep(3)
        lost = [v for v in writer.committed if v not in reader.arrived]
        out["records"] = len(writer.committed)
        out["not_read_back"] = len(lost)
        dup = _duplicates(cluster.bootstrap, topic)
        out["duplicates"] = dup
        out["fences"] = sum(1 for e in reaper.events() if e.get("event") == "neli fenced")
        return out
    finally:
        writer.stop.set()
        probe.stop.set()
        reader.stop.set()
        if reaper is not None:
            stop_all([reaper])
        try:
            with psycopg.connect(cluster.dsn, autocommit=True, connect_timeout=10) as c:
                c.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        except psycopg.Error:
            pass


def promotion(cluster: Cluster, writer: Writer, reader: Reader, out: dict) -> None:
    old = cluster.primary()
    cluster.pg_kill(old)
    new = cluster.promote()
    accepted = time.monotonic()  # `promote` returns once the new primary left recovery
    out["promotion_s"] = gap_after(writer, reader, accepted)
    say(f"promotion (node {old} -> node {new}): publication gap {out['promotion_s']} s after it accepted writes")
    cluster.rejoin()


def _duplicates(bootstrap: str, topic: str) -> int:
    c = Consumer({**QUIET, "bootstrap.servers": bootstrap, "group.id": f"bench-d-{uuid.uuid4().hex[:8]}"})
    c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    seen: set[bytes] = set()
    dup = idle = 0
    while idle < 10:
        msgs = [m for m in c.consume(5000, 0.2) if m.error() is None]
        idle = 0 if msgs else idle + 1
        for m in msgs:
            if m.value().startswith(b"probe-"):  # the probe's records (see Probe) are not the reaper's
                continue
            if m.value() in seen:
                dup += 1
            seen.add(m.value())
    c.close()
    return dup


def latency(single_dsn: str, single_bootstrap: str, cluster: Cluster, rows: int, seconds: float) -> dict:
    say("latency: single broker")
    single = throughput_and_latency(single_dsn, single_bootstrap, 1, rows, seconds)
    say(f"  {single}")
    # The same Postgres: only Kafka differs (a synchronous standby would add its flush to every commit).
    say("latency: three brokers, replication 3, min ISR 2")
    three = throughput_and_latency(single_dsn, cluster.bootstrap, 3, rows, seconds)
    say(f"  {three}")
    return {
        "single_broker": single,
        "three_brokers": three,
        "ratio_three_to_single": {
            "drain_records_per_s": round(three["drain_records_per_s"] / single["drain_records_per_s"], 3),
            "p99_ms": round(three["p99_ms"] / single["p99_ms"], 3),
        },
    }


def _unwind_once(signum: int, frame: object) -> None:
    # ignored from here on: a second SIGTERM must not cut the clean-up short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main(argv: list[str] | None = None) -> int:
    # a SIGTERM (an interrupted run) unwinds like Ctrl-C, so the reaper this run started is
    # stopped by its `finally` instead of publishing on, unseen, beside the next run
    signal.signal(signal.SIGTERM, _unwind_once)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rows, shorter phases")
    ap.add_argument("--skip-faults", action="store_true", help="only the throughput and latency figures")
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--skip-latency", action="store_true", help="only the fault gaps")
    ap.add_argument(
        "--rounds", type=int, default=1, help="each broker fault this many times (its figure: the worst round)"
    )
    ap.add_argument(
        "--reaper-env",
        action="append",
        default=[],
        metavar="REAPER_X=V",
        help="configuration of the reaper under faults",
    )
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    which = tuple(f for f in args.faults.split(",") if f)
    if unknown := set(which) - set(FAULTS):
        ap.error(f"unknown faults {sorted(unknown)}: choose among {', '.join(FAULTS)}")
    extra_env = dict(item.split("=", 1) for item in args.reaper_env)
    rows, seconds, pause = (20_000, 8.0, 2.0) if args.quick else (100_000, 20.0, 4.0)
    single_dsn = os.environ.get("OUTBOX_TEST_DSN", "postgresql://postgres@127.0.0.1:55432/outbox")
    single_bootstrap = os.environ.get("KAFKA_BOOTSTRAP", "127.0.0.1:59092")
    load_before = load_average()
    cluster = Cluster().up()
    result: dict = {"bench": "cluster", "reaper_env": extra_env}
    if not args.skip_latency:
        result.update(latency(single_dsn, single_bootstrap, cluster, rows, seconds))
    if not args.skip_faults:
        log_dir = Path(os.environ.get("OUTBOX_LOCAL_DIR", Path(__file__).resolve().parents[1] / ".local")) / "bench"
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            gaps = faults(cluster, log_dir, pause, which, extra_env, args.rounds)
        finally:
            cluster.up()  # heal whatever a failed run left
        broker = [v for k, v in gaps.items() if k.endswith("_s") and k != "promotion_s"]
        result["kafka_cores_steady"] = gaps.pop("kafka_cores_steady", None)
        result["split_s"] = gaps.pop("split")
        result["rounds_s"] = gaps.pop("rounds")
        result["appended_s"] = appended = gaps.pop("appended")
        result["gaps_s"] = gaps
        result["goals_s"] = GOALS
        result["goals_met"] = {
            "broker_loss": all(g is not None and g <= GOALS["broker_loss_s"] for g in broker),
            # the same goal, each gap counted to when Kafka appended the first record after it
            "broker_loss_appended": bool(appended)
            and all(g is not None and g <= GOALS["broker_loss_s"] for g in appended.values()),
            "promotion": gaps.get("promotion_s") is not None and gaps["promotion_s"] <= GOALS["promotion_s"],
        }
        say(f"gaps: {gaps}; goals {GOALS}: {result['goals_met']}")
    result["load_average"] = {"before": load_before, "after": load_average()}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
