"""`reaper run`: the harvester, the acker, the sweeper loop and the metrics server in one process.

Exit codes: harvester.exit_codes.ExitCode (OK, FAILURE: a component failed to start or stopped
while running, USAGE (also a DSN libpq refuses, at once), UNAVAILABLE at start: once database.startup_timeout has passed, or at once for
a schema not migrated, DRAIN_TIMEOUT: records left in flight at the drain's end or at a second
signal). Signals: see `Signals`.
"""

from __future__ import annotations

import gc
import signal
import sys
import threading
import time
from collections.abc import Callable

import tracker
from harvester import logs, product_version
from harvester.config import Config, ConfigError, ack_topics, acker_group, redacted
from harvester.election.group_bounds import SessionTimeoutRefused
from harvester.election.leader_topic import KafkaClusterUnknown, LeaderTopicMismatch
from harvester.election.timeouts import silent_broker_wait_ms
from harvester.exit_codes import ExitCode
from harvester.gauges import gauges_loop
from harvester.health_server import CannotListen, HealthServer
from harvester.metrics import get as get_metrics
from harvester.publishing.outbox_sql import make_pool
from harvester.publishing.ports import DEFAULT, Providers
from harvester.publishing.publisher import logs_safe
from harvester.services.inbox import inbox_loop
from harvester.services.sweeper import sweep_loop
from harvester.services.targets import BatchTarget, with_batch_tables
from harvester.startup_checks import Readiness, admin_client, await_services
from harvester.units import Harvester


def acked_targets(cfg: Config, targets: list[BatchTarget]) -> list[tuple[BatchTarget, str]]:
    """Each of `targets` (schemas with batch tables) that has an ack topic, with that topic; one line
    lists those that have none (their consumers can ack only through the tracker or the HTTP API)."""
    topics = ack_topics(cfg)
    out = [(t, topics[(t.dsn, t.schema)]) for t in targets if (t.dsn, t.schema) in topics]
    missing = [t.schema for t in targets if (t.dsn, t.schema) not in topics]
    if missing:
        logs.get("reaper.acker").info(
            "schemas with batch tables but no ack topic: no acker (set ack_topic on their harvester.outboxes entry)",
            schemas=missing,
        )
    return out


def _start_acker(
    cfg: Config, target: BatchTarget, topic: str, stop: threading.Event, failures: list
) -> threading.Thread:
    """An acker for one schema: acks read from `topic` clear bits of that schema's batches, and
    completion events go to its outbox table (the one harvester.services.targets picks)."""
    from harvester.services.acker import Acker

    a = cfg.acker
    acker = Acker(
        dsn=target.dsn,
        schema=target.schema,
        bootstrap_servers=cfg.kafka.bootstrap_servers,
        kafka_client=cfg.kafka.client,
        consumer_client=cfg.kafka.consumer,
        producer_client=cfg.kafka.producer,
        topic=topic,
        group=acker_group(cfg, topic),
        dead_letter_topic=a.dead_letter_topic,
        max_poll_records=a.max_poll_records,
        poll_timeout=a.poll_timeout,
        # a silent broker is given up as the election's clients give it up (kafka.* settings override)
        silent_wait_ms=silent_broker_wait_ms(cfg.harvester.heartbeat_timeout, cfg.harvester.session_timeout),
        tracker=tracker.Tracker(
            schema=target.schema,
            outbox_table=target.outbox_table,
            completion_topic=cfg.harvester.default_completion_topic,
            metrics_prefix=cfg.metrics.prefix,
        ),
        metrics=get_metrics(cfg.metrics.prefix),
    )
    main = (target.dsn, target.schema) == (cfg.database.dsn, cfg.database.schema)
    name = "acker" if main else f"acker {target.schema}"

    def run() -> None:
        try:
            acker.run(stop)
        except BaseException as exc:
            failures.append((name, exc))
            logs.get("reaper.acker").error("acker failed", schema=target.schema, error=logs_safe(exc))
            return
        if not stop.is_set():
            failures.append((name, ComponentStopped(f"the {name} stopped while the reaper was running")))

    t = threading.Thread(target=run, name="reaper-acker" if main else f"reaper-acker-{target.schema}", daemon=True)
    t.start()
    return t


# Each record in flight holds a few container objects (its row, header lists, the delivery callback)
# until Kafka acknowledges it. At the default threshold (700) the collector runs dozens of times per
# mark and keeps re-walking tens of thousands of live records; the hot path makes no reference
# cycles, so a rarer first generation costs little memory and saves ~2 µs of GIL time a record.
GC_THRESHOLD_0 = 50_000


def tune_gc() -> None:
    """Garbage-collector settings for a reaper process (see tune_process)."""
    gc.freeze()  # what start-up loaded (modules, config) is never walked again
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD_0, gen1, gen2)


# The interpreter's thread switch interval. The marking thread is the harvester's slowest stage:
# each time its mark returns from Postgres it needs the GIL back, and with the default 5 ms it waits
# up to that long while the producing thread runs its produce loop (which holds the GIL). 0.5 ms
# hands the GIL over ten times sooner: ~15% more records a second on a pre-filled outbox here, at
# the cost of more frequent thread switches in a busy process.
SWITCH_INTERVAL = 0.0005


def tune_process() -> None:
    """Process settings for a reaper: the garbage collector's (tune_gc) and the thread switch
    interval. Called by `reaper run`, and by anything else that runs a harvester in-process."""
    tune_gc()
    sys.setswitchinterval(SWITCH_INTERVAL)


class Signals:
    """What `reaper run` does on a signal. SIGTERM or SIGINT: stop (drain, hand over); a second one
    while stopping: stop at once, without waiting out the drain. SIGHUP: re-read the tenants file
    (see `reload_on_hup`); it never stops the process. The handlers only set flags: the main thread logs
    and acts on them (logging or reading files inside a handler could deadlock on a lock the
    interrupted code holds)."""

    def __init__(self) -> None:
        self.term = threading.Event()  # stop
        self.hurry = threading.Event()  # stop at once
        self.hup = threading.Event()  # re-read
        self._received: list[str] = []  # names of stopping signals, in order (appended by the handler)
        self._logged = 0

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop(self, signum: int, _frame: object) -> None:
        self._received.append(signal.Signals(signum).name)
        if self.term.is_set():
            self.hurry.set()
        self.term.set()

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self.hup.set()

    def log_received(self, log) -> None:
        """One line per stopping signal received since the last call."""
        while self._logged < len(self._received):
            name = self._received[self._logged]
            if self._logged == 0:
                log.info("signal received: stopping", signal=name)
            else:
                log.warning("signal received again: stopping at once, without waiting for the drain", signal=name)
            self._logged += 1


def reload_on_hup(cfg: Config, console, log) -> None:
    """SIGHUP: the console's tenants file (http.tenants_file) is read again, as `reaper serve` reads
    it (a bad file keeps the tenants already loaded); without a console or a tenants file there is
    nothing to re-read, which is logged. Never raises."""
    if console is None or not cfg.http.tenants_file:
        log.info(
            "SIGHUP received: nothing to re-read (the tenants file is re-read only with console.run and "
            "http.tenants_file set)",
            console=console is not None,
        )
        return
    log.info("SIGHUP received: re-reading the tenants file", file=cfg.http.tenants_file)
    try:
        console.reload_tenants()
    except Exception as exc:  # a bad file must not stop the reaper
        log.error("tenants file not reloaded: keeping the tenants already loaded", error=logs_safe(exc))


class ComponentStopped(RuntimeError):
    """A component's thread of `reaper run` ended while the process was not stopping."""


def component_thread(
    name: str, target: Callable[..., object], args: tuple, stop: threading.Event, failures: list
) -> threading.Thread:
    """A daemon thread running one of `reaper run`'s components (`target(*args)`, which returns once
    `stop` is set). If it raises, or returns before `stop` is set, the component is added to
    `failures` (logged): the main loop then stops the process with ExitCode.FAILURE rather than run
    on without it."""

    def body() -> None:
        try:
            target(*args)
        except BaseException as exc:
            failures.append((name, exc))
            logs.get("reaper").error("component stopped by an error", component=name, exc_info=exc)
            return
        if not stop.is_set():
            failures.append((name, ComponentStopped(f"the {name} stopped while the reaper was running")))

    return threading.Thread(target=body, daemon=True, name=f"reaper-{name.replace(' ', '-')}")


def _join_all(threads: list[threading.Thread], timeout: float, hurry: threading.Event) -> None:
    """Wait up to `timeout` in all for the threads that were started; not at all once `hurry` is set."""
    deadline = time.monotonic() + timeout
    for t in threads:
        if t.ident is None:
            continue  # never started (start-up failed before it)
        while t.is_alive() and not hurry.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            t.join(min(0.1, left))


def run(cfg: Config, *, providers: Providers = DEFAULT) -> int:
    log = logs.get("reaper")
    tune_process()
    log.info("starting", version=product_version(), config=redacted(cfg), providers=providers.description)
    stop = threading.Event()
    signals = Signals()
    signals.install()
    term = signals.term

    # The acker and sweeper run tracker code in this process: completion events go to this
    # schema's outbox table and, for batches opened without one, to the configured topic.
    m = get_metrics(cfg.metrics.prefix)
    m.build_info.labels(product_version()).set(1)
    admin = admin_client(cfg)
    try:
        ready = await_services(cfg, admin, term)
    except ConfigError as exc:  # a DSN libpq refuses: no wait can help
        log.error("cannot start", error=str(exc))
        return ExitCode.USAGE
    signals.log_received(log)
    if not ready:
        return ExitCode.UNAVAILABLE
    try:
        pool = make_pool(cfg.database.dsn, 2, name="reaper-aux")
    except Exception as exc:
        log.error("cannot start", error=logs_safe(exc))
        return ExitCode.UNAVAILABLE

    failures: list[tuple[str, BaseException]] = []
    threads: list[threading.Thread] = []
    http = None
    console = None
    harvester = None
    code = ExitCode.OK
    drained = True
    try:
        if cfg.metrics.enabled:
            http = HealthServer(cfg.metrics.host, cfg.metrics.port, Readiness(pool, admin)).start()
            log.info("metrics server listening", port=http.port)
            threads.append(component_thread("gauges", gauges_loop, (cfg, pool, stop), stop, failures))
        if cfg.console.run:  # the operator's console (harvester/services/console/)
            from harvester.services.console.standalone import ConsoleServer

            console = ConsoleServer(cfg).start()
            log.info("console listening", host=cfg.console.host, port=cfg.console.port)
        # Every schema of the configuration's outboxes that has batch tables, not only `database`'s.
        targets = with_batch_tables(cfg) if cfg.sweeper.enabled or cfg.settler.enabled or cfg.acker.enabled else []
        if cfg.sweeper.enabled:
            threads.append(component_thread("sweeper", sweep_loop, (cfg, pool, stop, targets), stop, failures))
        if cfg.inbox.enabled:
            threads.append(component_thread("inbox", inbox_loop, (cfg, pool, stop), stop, failures))
        if cfg.settler.enabled:
            from harvester.services.claim_settler import (
                ClaimSettler,  # folds ack claims left by busy commits; safe with several reapers
            )

            for target in targets:
                settler = ClaimSettler(
                    dsn=target.dsn,
                    schema=target.schema,
                    outbox_table=target.outbox_table,
                    completion_topic=cfg.harvester.default_completion_topic,
                    interval=cfg.settler.interval,
                    metrics=m,
                )
                threads.append(component_thread(f"settler {target.schema}", settler.run, (stop,), stop, failures))
        for t in threads:
            t.start()
        if cfg.acker.enabled:  # one acker per schema with batch tables and an ack topic
            for target, topic in acked_targets(cfg, targets):
                threads.append(_start_acker(cfg, target, topic, stop, failures))
        if cfg.harvester.enabled:
            try:
                harvester = Harvester(cfg, providers=providers).start()
            except (LeaderTopicMismatch, KafkaClusterUnknown, SessionTimeoutRefused) as exc:
                log.error("cannot start", error=str(exc))
                code = ExitCode.USAGE
        while code == ExitCode.OK and not term.wait(0.2):
            if signals.hup.is_set():
                signals.hup.clear()
                reload_on_hup(cfg, console, log)
            if harvester is not None and harvester.error is not None:
                failures.append(("harvester", harvester.error))
            if failures:
                break
    except ConfigError as exc:  # found only once a part starts (the console's tokens)
        log.error("cannot start", error=str(exc))
        code = ExitCode.USAGE
    except CannotListen as exc:  # metrics.port taken: named as the console's port is
        failures.append(("metrics server", exc))
    except Exception as exc:
        failures.append(("startup", exc))
    finally:
        # Whatever ended the run, everything that started is stopped, and a failure to stop one
        # part is logged and stops the others all the same.
        signals.log_received(log)
        started = time.monotonic()
        if harvester is not None:
            hurry = signals.hurry
            drained = _quietly(log, failures, "harvester", lambda: harvester.stop(hurry=hurry)) is True
        stop.set()
        _join_all(threads, cfg.harvester.drain_timeout, signals.hurry)
        if http is not None:
            _quietly(log, failures, "metrics server", http.stop)
        if console is not None:
            _quietly(log, failures, "console", console.stop)
        _quietly(log, failures, "database pool", pool.close)
        signals.log_received(log)
        if signals.hup.is_set():
            log.info("SIGHUP received while stopping: nothing re-read")
        log.info("stopped", drained=drained, seconds=round(time.monotonic() - started, 3))
    if code != ExitCode.OK:
        return code
    if failures:
        for what, err in failures:
            log.error("component failed", component=what, error=logs_safe(err))
        return ExitCode.FAILURE
    if not drained:
        return ExitCode.DRAIN_TIMEOUT
    return ExitCode.OK


def _quietly(log, failures: list, what: str, step: Callable[[], object]) -> object:
    """`step()`, or None if it raised: logged and added to `failures`, never raised over what ended the run."""
    try:
        return step()
    except Exception as exc:
        failures.append((f"stopping the {what}", exc))
        log.error("stopping failed", component=what, error=logs_safe(exc))
        return None


def configure_logging(cfg: Config) -> None:
    fmt = cfg.logging.format
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    logs.configure(fmt, cfg.logging.level)
