"""`make demo`: one fan-out of 100,000 items, end to end, with a leader killed midway.

1. brings up the local Postgres and Kafka (deploy/local/services.py), unless already running;
2. `reaper migrate` into a fresh schema, and creates this run's topics;
3. starts two `reaper run` processes (one leads, one stands by) and two example consumers;
4. the example application opens a batch, enqueues the items with `outbox.enqueue` and closes
   the batch, all in one transaction;
5. shows progress (published, acked, pending, who leads) until the completion event arrives;
   once a share of the items is published it SIGKILLs the leader and shows the standby take over;
6. prints the completion event and the elapsed time, then stops everything it started and drops
   its schema and topics (also on Ctrl-C or failure).

    python -m demo [--items N] [--consumers N] [--kill-at 0.3] [--timeout 150] [--keep-services]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from demo.app import process_catalog

REPO = Path(__file__).resolve().parents[1]
SERVICES = REPO / "deploy" / "local" / "services.py"
STATE = Path(os.environ.get("OUTBOX_LOCAL_DIR", REPO / ".local")).resolve() / "demo"
TTY = sys.stdout.isatty()
QUIET = {"log_level": 4}  # librdkafka: warnings and errors only, no informational lines in the display


class DemoFailed(RuntimeError):
    pass


def say(text: str = "") -> None:
    if TTY:
        sys.stdout.write("\r\033[K")
    print(text, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ processes


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    metrics_port: int | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float) -> int | None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """This reaper's unlabelled samples, by name (empty if it does not answer)."""
        if self.metrics_port is None or not self.alive():
            return {}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1) as r:
                text = r.read().decode()
        except OSError:
            return {}
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@dataclass
class Run:
    dsn: str
    bootstrap: str
    items: int
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    children: list[Child] = field(default_factory=list)

    @property
    def schema(self) -> str:
        return f"demo_{self.run_id}"

    def topic(self, name: str) -> str:
        return f"demo-{self.run_id}-{name}"

    @property
    def folder(self) -> Path:
        return STATE / self.run_id

    def reaper_env(self, metrics_port: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "REAPER_DATABASE__DSN": self.dsn,
                "REAPER_DATABASE__SCHEMA": self.schema,
                "REAPER_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap,
                "REAPER_HARVESTER__LEADER_TOPIC": self.topic("leader"),
                "REAPER_HARVESTER__LEADER_GROUP": self.topic("leader-group"),
                # A killed leader's partition moves after the session timeout: keep the demo short.
                "REAPER_HARVESTER__SESSION_TIMEOUT": "6",
                "REAPER_HARVESTER__HEARTBEAT_TIMEOUT": "2",
                "REAPER_HARVESTER__DEFAULT_COMPLETION_TOPIC": self.topic("completions"),
                "REAPER_ACKER__TOPIC": self.topic("acks"),
                "REAPER_ACKER__GROUP": self.topic("acker"),
                "REAPER_ACKER__DEAD_LETTER_TOPIC": self.topic("acks-dead-letter"),
                "REAPER_KAFKA__CONSUMER__SESSION_TIMEOUT_MS": "6000",
                "REAPER_KAFKA__CONSUMER__HEARTBEAT_INTERVAL_MS": "1000",
                "REAPER_METRICS__HOST": "127.0.0.1",
                "REAPER_METRICS__PORT": str(metrics_port),
                "REAPER_METRICS__BACKLOG_INTERVAL": "0.5",
                "REAPER_LOGGING__FORMAT": "json",
            }
        )
        return env

    def spawn(self, name: str, args: list[str], env: dict[str, str], metrics_port: int | None = None) -> Child:
        log = self.folder / f"{name}.log"
        with open(log, "wb") as out:
            # Own session: a Ctrl-C in the terminal reaches only the demo, which stops children in order.
            proc = subprocess.Popen(
                args,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        child = Child(name, proc, log, metrics_port)
        self.children.append(child)
        return child


# ------------------------------------------------------------------ set-up and tear-down


def services_running() -> bool:
    r = subprocess.run([sys.executable, str(SERVICES), "status"], capture_output=True, text=True)
    return r.returncode == 0


def services_up() -> dict[str, str]:
    r = subprocess.run([sys.executable, str(SERVICES), "up"], capture_output=True, text=True)
    if r.returncode != 0:
        raise DemoFailed(f"local services did not start:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line and not line.startswith("["))


def create_topics(run: Run) -> None:
    admin = AdminClient({"bootstrap.servers": run.bootstrap, **QUIET})
    wanted = {"leader": 1, "items": 4, "acks": 4, "acks-dead-letter": 1, "completions": 1}
    futures = admin.create_topics(
        [NewTopic(run.topic(n), num_partitions=p, replication_factor=1) for n, p in wanted.items()],
        operation_timeout=30,
    )
    for f in futures.values():
        f.result(timeout=30)


def drop_everything(run: Run) -> None:
    try:
        with psycopg.connect(run.dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(run.schema)))
    except psycopg.Error as exc:
        say(f"  (could not drop schema {run.schema}: {exc})")
    try:
        admin = AdminClient({"bootstrap.servers": run.bootstrap, **QUIET})
        names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(f"demo-{run.run_id}-")]
        if names:
            for f in admin.delete_topics(names, operation_timeout=30).values():
                f.result(timeout=30)
    except KafkaException as exc:
        say(f"  (could not delete topics: {exc})")


# ------------------------------------------------------------------ watching


class CompletionWatcher(threading.Thread):
    """Consumes the completion topic; keeps the first event of our batch."""

    def __init__(self, run: Run) -> None:
        super().__init__(name="completion-watcher", daemon=True)
        self.consumer = Consumer(
            {
                **QUIET,
                "bootstrap.servers": run.bootstrap,
                "group.id": run.topic("watcher"),
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
            }
        )
        self.consumer.subscribe([run.topic("completions")])
        self.stop = threading.Event()
        self.event: dict | None = None
        self.received_at: float | None = None
        self.batch_id: int | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                msg = self.consumer.poll(0.1)
                if msg is None or msg.error():
                    continue
                event = json.loads(msg.value())
                if self.event is None and event.get("batch_id") == self.batch_id:
                    self.event, self.received_at = event, time.monotonic()
        finally:
            self.consumer.close()


def leader_of(reapers: list[Child]) -> Child | None:
    for r in reapers:
        if r.metrics().get("reaper_leader") == 1.0:
            return r
    return None


def wait_for(what: str, check, timeout: float, reapers: list[Child]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for r in reapers:
            if not r.alive():
                raise DemoFailed(f"{r.name} exited with {r.proc.returncode} while waiting for {what}:\n{r.log_tail()}")
        time.sleep(0.1)
    raise DemoFailed(f"timed out after {timeout:.0f}s waiting for {what}")


# ------------------------------------------------------------------ the demo


def demo(args: argparse.Namespace, started: float, cleanup: list) -> None:
    def t() -> str:
        return f"[{time.monotonic() - started:6.1f}s]"

    say(f"{t()} local services: Postgres and Kafka")
    was_running = services_running()
    env = services_up()
    if not was_running and not args.keep_services:
        cleanup.append(
            (
                "stop local services",
                lambda: subprocess.run([sys.executable, str(SERVICES), "down"], capture_output=True),
            )
        )
    run = Run(env["OUTBOX_TEST_DSN"], env["KAFKA_BOOTSTRAP"], args.items)
    run.folder.mkdir(parents=True, exist_ok=True)
    cleanup.append(("logs folder", run.folder))  # removed after a successful run, kept after a failure
    say(f"{t()} {'already running' if was_running else 'started'}: {run.dsn}, kafka {run.bootstrap}")
    cleanup.append(("drop schema and topics", lambda: drop_everything(run)))
    cleanup.append(("stop processes", lambda: [c.stop(25) for c in reversed(run.children)]))

    # reaper migrate, through the real command line.
    r = subprocess.run(
        [sys.executable, "-m", "harvester.cli", "migrate"],
        cwd=REPO,
        env=run.reaper_env(0),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0:
        raise DemoFailed(f"reaper migrate failed:\n{r.stdout}\n{r.stderr}")
    create_topics(run)
    say(f"{t()} reaper migrate: schema {run.schema} ready; topics demo-{run.run_id}-* created")

    reapers = []
    for n in (1, 2):
        port = free_port()
        reapers.append(
            run.spawn(
                f"reaper-{n}", [sys.executable, "-m", "harvester.cli", "run"], run.reaper_env(port), metrics_port=port
            )
        )
        if n == 1:  # let the first one lead, so the picture is simple: reaper-1 leads, reaper-2 stands by
            wait_for("reaper-1 to lead", lambda: leader_of(reapers), 60, reapers)
    leader = wait_for("a leader", lambda: leader_of(reapers), 60, reapers)
    say(
        f"{t()} two reapers running: {leader.name} leads (pid {leader.proc.pid}), "
        f"metrics on :{reapers[0].metrics_port} and :{reapers[1].metrics_port}"
    )

    consumer_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for n in range(1, args.consumers + 1):
        run.spawn(
            f"consumer-{n}",
            [
                sys.executable,
                "-m",
                "demo.consumer",
                run.bootstrap,
                run.topic("items"),
                run.topic("acks"),
                run.topic("consumers"),
            ],
            consumer_env,
        )
    watcher = CompletionWatcher(run)
    watcher.start()
    cleanup.append(("stop completion watcher", watcher.stop.set))
    say(f"{t()} {args.consumers} example consumers subscribed to {run.topic('items')}")

    fan = process_catalog(
        run.dsn,
        schema=run.schema,
        catalog=f"catalog-{run.run_id}",
        items=args.items,
        item_topic=run.topic("items"),
        completion_topic=run.topic("completions"),
    )
    watcher.batch_id = fan.batch_id
    say(
        f"{t()} app: batch {fan.batch_id} opened, {fan.items:,} items enqueued in {fan.groups} groups and closed, "
        f"one transaction, {fan.seconds:.2f}s"
    )

    progress(run, reapers, watcher, fan.batch_id, args, started, t)


def progress(
    run: Run,
    reapers: list[Child],
    watcher: CompletionWatcher,
    batch_id: int,
    args: argparse.Namespace,
    started: float,
    t,
) -> None:
    count_rows = sql.SQL("SELECT count(*) FROM {} WHERE topic = %s").format(sql.Identifier(run.schema, "outbox"))
    pending_of = sql.SQL("SELECT pending, state FROM {} WHERE id = %s").format(sql.Identifier(run.schema, "batch"))
    killed: Child | None = None
    killed_at = 0.0
    took_over = False
    last_line = 0.0
    deadline = started + args.timeout
    with psycopg.connect(run.dsn, autocommit=True) as conn:
        while watcher.event is None:
            if time.monotonic() > deadline:
                raise DemoFailed(f"no completion event within {args.timeout:.0f}s")
            left = conn.execute(count_rows, [run.topic("items")]).fetchone()[0]
            pending, state = conn.execute(pending_of, [batch_id]).fetchone()
            published, acked = run.items - left, run.items - pending
            leader = leader_of(reapers)
            if killed is None and published >= args.kill_at * run.items and leader is not None:
                killed, killed_at = leader, time.monotonic()
                os.kill(leader.proc.pid, signal.SIGKILL)
                leader.proc.wait()
                say(f"{t()} SIGKILL -> {leader.name} (pid {leader.proc.pid}), the leader, at {published:,} published")
                continue
            if killed is not None and not took_over and leader is not None:
                took_over = announce_takeover(leader, killed_at, t)
            for c in run.children:
                if c is not killed and not c.alive():
                    raise DemoFailed(f"{c.name} exited with {c.proc.returncode}:\n{c.log_tail()}")
            now = time.monotonic()
            line = (
                f"{t()} published {published:>7,}/{run.items:,}  acked {acked:>7,}  pending {pending:>7,}  "
                f"batch {state:<8} leader {leader.name if leader else '(none)'}"
            )
            if TTY:
                sys.stdout.write("\r\033[K" + line)
                sys.stdout.flush()
            elif now - last_line >= 1.0:
                print(line, flush=True)
                last_line = now
            time.sleep(0.25)
    if killed is None:
        raise DemoFailed("the completion arrived before the leader could be killed: use a lower --kill-at")
    if not took_over:  # it took over and published the completion within one refresh
        leader = leader_of(reapers)
        if leader is None:
            raise DemoFailed("the batch completed but no standby was seen taking over")
        announce_takeover(leader, killed_at, t)
    say(f"{t()} completion event received on {run.topic('completions')}:")
    say("    " + json.dumps(watcher.event))
    survivors = [r for r in reapers if r is not killed]
    m = survivors[0].metrics()
    processed = 0
    for c in run.children:
        if c.name.startswith("consumer-"):
            c.stop(25)
            processed += consumer_count(c)
    say(
        f"{t()} consumers processed {processed:,} messages for {run.items:,} items "
        f"({processed - run.items:,} redelivered: at least once, never lost); the standby's acker "
        f"counted {m.get('reaper_acks_duplicate_total', 0):,.0f} duplicate acks, which changed nothing"
    )


def announce_takeover(leader: Child, killed_at: float, t) -> bool:
    m = leader.metrics()
    say(
        f"{t()} {leader.name} took over as leader {time.monotonic() - killed_at:.1f}s after the kill "
        f"(acquisitions {m.get('reaper_leader_acquisitions_total', 0):.0f})"
    )
    return True


def consumer_count(child: Child) -> int:
    """The `{"processed": N}` line an example consumer prints when it stops."""
    for line in reversed(child.log.read_text(errors="replace").splitlines()):
        if line.startswith('{"processed"'):
            return json.loads(line)["processed"]
    raise DemoFailed(f"{child.name} did not report what it processed:\n{child.log_tail()}")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m demo", description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--kill-at", type=float, default=0.3, help="kill the leader once this share is published")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds before the demo gives up")
    ap.add_argument("--keep-services", action="store_true", help="leave Postgres and Kafka running afterwards")
    args = ap.parse_args(argv)
    started = time.monotonic()
    cleanup: list[tuple[str, object]] = []
    # Ctrl-C and SIGTERM (CI, `timeout`) both stop the demo and clean up; set SIGINT explicitly,
    # since a shell starting us in the background would have it ignored.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    code = 0
    try:
        demo(args, started, cleanup)
        say(f"demo finished in {time.monotonic() - started:.1f}s")
    except KeyboardInterrupt:
        say("interrupted: stopping everything the demo started")
        code = 130
    except DemoFailed as exc:
        say(f"demo FAILED: {exc}")
        say(f"logs kept in {STATE}")
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for what, fn in reversed(cleanup):
            try:
                if isinstance(fn, Path):
                    if code == 0:
                        shutil.rmtree(fn, ignore_errors=True)
                    continue
                fn()
            except Exception as exc:  # keep cleaning up
                say(f"  clean-up step {what!r} failed: {exc}")
        say(f"stopped everything the demo started ({time.monotonic() - started:.1f}s in all)")
    return code
