"""`reaper` configuration: a YAML file, then environment-variable overrides, then validation.

Every key has a default; `REAPER_<SECTION>__<KEY>` overrides `<section>.<key>` (e.g.
`REAPER_DATABASE__DSN`, `REAPER_HARVESTER__HEARTBEAT_TIMEOUT`). Kafka client settings under
`kafka.client` are passed to librdkafka as they are (`REAPER_KAFKA__CLIENT__SASL_PASSWORD` sets
`sasl.password`). A bad value fails at start with a ConfigError naming the key and the value.

The schema is written once, below: each key is a dataclass field whose type and default are the
field's, and whose rule (description, bounds, allowed values, secrecy) is `key(...)`'s metadata
(the vocabulary is harvester.config_schema). Coercion, the per-key checks, the environment-variable names, the redaction of secrets and the
configuration reference (deploy/config_reference.py) are all derived from it. Checks that relate
two keys are written out in `_check_relations`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, get_origin, get_type_hints

import psycopg
import yaml
from psycopg.conninfo import conninfo_to_dict

from harvester.config_schema import (  # noqa: F401  (ConfigError, redact, redact_dsn: importers use them from here)
    ENV_PREFIX,
    TOPIC,
    Check,
    ConfigError,
    Rule,
    Setting,
    key,
    redact,
    redact_dsn,
)
from tracker.errors import InvalidIdentifier
from tracker.schema import check_identifier

# Producer settings the harvester's per-key ordering rests on; configuration may not change them.
REQUIRED_PRODUCER = {
    "enable.idempotence": True,
    "message.timeout.ms": 0,  # no timeouts: they are the one failure that can leave a gap
    "enable.gapless.guarantee": True,  # any other gap-making failure is fatal: nothing after it is written
}
# librdkafka settings reaper sets itself; configuration may not name them.
RESERVED_KAFKA = ("bootstrap.servers", "group.id", "on_delivery", "error_cb", "on_commit")

MAX_LANES = 64
MAX_UNITS = 256
# harvester.step_down_after's smallest non-zero value: a database restart fails marks for a moment
STEP_DOWN_MIN = 1.0


# ------------------------------------------------------------------ the schema

POSITIVE: dict[str, Any] = {"gt": 0}


class OutboxEntry(TypedDict, total=False):
    """One entry of harvester.outboxes; missing keys come from the `database` section (lanes: 1)."""

    name: str
    dsn: str
    schema: str
    table: str
    lanes: int
    ack_topic: str


@dataclass
class DatabaseConfig:
    dsn: str = key(
        "postgresql://postgres@127.0.0.1:55432/outbox",
        "libpq URI or key=value string of the database holding the outbox",
    )
    schema: str = key(
        "reaper",
        "schema of the outbox, batch and batch_group tables (`reaper migrate` creates it)",
        check=Check("SQL identifier", identifier="schema"),
    )
    outbox_table: str = key(
        "outbox", "name of the outbox table in that schema", check=Check("SQL identifier", identifier="table")
    )
    pool_size: int = key(
        6, "database connections of one reaper (mark, purge workers, upkeep, acker, sweeper)", **POSITIVE
    )
    startup_timeout: float = key(
        60.0,
        "`reaper run`: how long the start-up checks wait for the database (a primary, when the DSN says "
        "target_session_attrs=read-write) and for Kafka to answer (seconds), then exit 3; a schema that is not "
        "migrated exits 3 at once",
        ge=0,
        le=86400,
        note="0 = exit 3 at the first failed check",
    )


@dataclass
class KafkaConfig:
    bootstrap_servers: str = key("127.0.0.1:59092", "Kafka brokers, host:port[,host:port...]")
    client: dict[str, Any] = key({}, "librdkafka settings for every client (security.protocol, sasl.*, ssl.*, ...)")
    producer: dict[str, Any] = key({}, "librdkafka settings for the producer only, over kafka.client")
    consumer: dict[str, Any] = key({}, "librdkafka settings for the consumers only, over kafka.client")


@dataclass
class HarvesterConfig:
    enabled: bool = key(True, "run the harvester (leader election and publishing) in this process")
    leader_topic: str = key(
        "__reaper_leader",
        "topic for leader election, one partition per harvest unit; the holder of partition u leads unit u",
        check=TOPIC,
    )
    leader_group: str = key("reaper", "consumer group of all instances of one deployment")
    min_poll_interval: float = key(0.1, "seconds between the leader's heartbeats", **POSITIVE)
    heartbeat_timeout: float = key(
        5.0, "a leader that sees none of its heartbeats for this long fences itself (seconds)", **POSITIVE
    )
    session_timeout: float = key(
        15.0, "leader-group session timeout (seconds); must exceed heartbeat_timeout", **POSITIVE
    )
    resume_steady: float = key(
        1.0,
        "a fenced leader resumes only once the heartbeats it sent over this long have come back, each "
        "within 3/4 of heartbeat_timeout (seconds); doubled, up to 4 times as long, while it keeps fencing again soon after resuming",
        ge=0,
        le=60,
        note="0 = resume at the first heartbeat back",
    )
    step_down_after: float = key(
        10.0,
        "a leader whose database work has gone unanswered this long, on every unit it leads, fences, leaves the "
        "leader group so another reaper takes over, and joins again once its database answers (seconds)",
        ge=0,
        le=3600,
        note="0 = never step down; otherwise at least 1",
    )
    mark_batch: int = key(5000, "rows claimed by one mark query", **POSITIVE)
    max_in_flight: int = key(20000, "records produced and awaiting their delivery reports", **POSITIVE)
    mark_deadline: float = key(5.0, "a mark-and-produce cycle longer than this forces a remark (seconds)", **POSITIVE)
    idle_poll_interval: float = key(0.005, "pause after a mark that found nothing (seconds)", **POSITIVE)
    purge_batch: int = key(5000, "rows deleted by one purge statement", **POSITIVE)
    purge_workers: int = key(2, "connections purging delivered rows in parallel", **POSITIVE)
    vacuum_interval: float = key(
        2.0,
        "the leader vacuums the outbox this often while it purges (seconds)",
        ge=0,
        note="0 = autovacuum only",
    )
    drain_timeout: float = key(10.0, "on shutdown, wait this long for in-flight records (seconds)", **POSITIVE)
    default_completion_topic: str = key(
        "batch-completions", "topic of completion events for batches opened without one", check=TOPIC
    )
    # Each new leader's init_transactions fences the previous leader's producer at the broker, so
    # even a paused (SIGSTOP, frozen VM) old leader can write nothing after the takeover.
    transactional_id: str = key(
        "",
        "publish in Kafka transactions under this id (same on every instance; producers `<id>` and `<id>#1`, taken "
        "in turn): a new leader fences the old one at the broker; rows are purged after commit. Empty = off",
        check=Check(
            "empty, or 1-200 of A-Z a-z 0-9 . _ : -",
            r"[A-Za-z0-9._:-]{1,200}",
            "{value!r} must be 1-200 of A-Z a-z 0-9 . _ : -",
            optional=True,
        ),
    )
    trace_spans: bool = key(
        False,
        "emit an OpenTelemetry PRODUCER span per published row, linked to the trace context stored with it "
        "(needs the otel extra and a configured tracer provider)",
    )
    lanes: int = key(
        1,
        "harvest units of the `database` outbox: rows are split by md5(key) mod lanes; change only by draining, "
        "then switching (the documentation's page on running and scaling the reaper says how)",
        ge=1,
        le=MAX_LANES,
    )
    outboxes: list[OutboxEntry] = key(
        [],
        "outboxes to harvest, each {name, dsn, schema, table, lanes, ack_topic} (missing keys from `database`); "
        "empty: the `database` outbox. ack_topic: the ack topic of the entry's schema when it is not the `database` "
        "section's (that one acks on acker.topic); each schema with batch tables and an ack topic gets its own acker, "
        "in consumer group `<acker.group>-<ack_topic>`",
    )
    lane_index: bool = key(
        True,
        "with lanes > 1, build (CONCURRENTLY, by lane 0's leader) and mark through an index on (lane, id), so each "
        "lane reads only its own rows; costs each outbox insert one index entry",
    )


@dataclass
class AckerConfig:
    enabled: bool = key(True, "run the acker (ack-topic consumer) in this process")
    topic: str = key("acks", "topic consumers produce acks to, keyed by batch id", check=TOPIC)
    group: str = key("reaper-acker", "consumer group of the ackers")
    dead_letter_topic: str = key("acks-dead-letter", "rejected acks go here with the reason", check=TOPIC)
    max_poll_records: int = key(100000, "acks folded into one round of masked UPDATEs", **POSITIVE)
    poll_timeout: float = key(0.2, "seconds one poll waits for ack messages", **POSITIVE)


@dataclass
class SweeperConfig:
    enabled: bool = key(True, "run the sweeper (expiry and retention) in this process")
    interval: float = key(30.0, "seconds between sweeps", **POSITIVE)
    idle_expiry: float = key(
        86400.0, "expire open and closed batches with no add, close or ack for this long (seconds)", **POSITIVE
    )
    retention: float = key(
        7 * 86400.0, "delete complete and expired batches this long after they finished (seconds)", **POSITIVE
    )
    chunk: int = key(1000, "batches handled per sweep statement", **POSITIVE)
    expiry_topic: str = key(
        "",
        "topic of expiry events (one per expired batch); empty = the batch's completion topic",
        check=dataclasses.replace(TOPIC, allowed="empty, or a Kafka topic name", optional=True),
    )


@dataclass
class InboxConfig:
    """The inbox's partitions (tracker.inbox): made ahead of time, dropped whole once expired."""

    enabled: bool = key(True, "run the inbox maintenance in this process (safe with several reapers)")
    interval: float = key(60.0, "seconds between inbox maintenance runs", **POSITIVE)
    retention: float = key(
        7 * 86400.0,
        "keep consumers' message ids at least this long (seconds); a message redelivered later runs again",
        ge=60,
        le=3660 * 86400,
    )
    bucket: float = key(
        86400.0,
        "time span of one inbox partition (seconds); ids are kept up to retention + bucket",
        ge=60,
        le=31 * 86400,
    )
    ahead: float = key(3 * 86400.0, "make inbox partitions this far ahead of time (seconds)", ge=0, le=366 * 86400)
    max_drops: int = key(10, "expired inbox partitions dropped per run at most", ge=1, le=1000)


@dataclass
class SettlerConfig:
    enabled: bool = key(
        True,
        "run the settler: folds consumers' ack claims whose commit found the batch row busy, and finished "
        "children into their parents",
    )
    interval: float = key(
        0.01,
        "how often the settler looks for unsettled claims and finished children (seconds); bounds how long a "
        "completion can lag its last ack's commit, and a parent its last child's finish",
        **POSITIVE,
    )


@dataclass
class MetricsConfig:
    enabled: bool = key(True, "serve /metrics, /healthz and /readyz")
    host: str = key("0.0.0.0", "address the HTTP endpoint listens on")
    port: int = key(9400, "port of /metrics, /healthz and /readyz (0 = any free port)", ge=0, le=65535)
    prefix: str = key(
        "reaper",
        "prefix of every metric name the sidecar exports (harvester, acker, settler, sweeper, tracker calls, `reaper serve`)",
        check=Check(
            "metric name: A-Z a-z 0-9 _, not starting with a digit",
            r"[a-zA-Z_][a-zA-Z0-9_]*",
            "{value!r} is not a valid metric name prefix",
        ),
    )
    backlog_interval: float = key(5.0, "seconds between the backlog and batch-table gauge queries", **POSITIVE)


@dataclass
class LoggingConfig:
    format: str = key(
        "auto", "json, console, or auto (console in a terminal, else json)", choices=("auto", "json", "console")
    )
    level: str = key(
        "info", "debug, info, warning or error", choices=("debug", "info", "warning", "error"), ignore_case=True
    )


@dataclass
class HttpConfig:
    """`reaper serve`: the tracker over HTTP (harvester/services/http/)."""

    host: str = key("127.0.0.1", "`reaper serve`: address to listen on")
    port: int = key(8400, "`reaper serve`: TCP port", gt=0, le=65535)
    tokens: str = key(
        "",
        "bearer tokens, comma-separated (prefer tokens_file); none: refuse to start unless local_mode",
        secret=True,
    )
    tokens_file: str = key("", "file of bearer tokens, one per line ('#' starts a comment)")
    tenants_file: str = key(
        "",
        "YAML file of tenants: each one's token hashes (sha256:...) and allowed completion topics; re-read on "
        "change and on SIGHUP",
    )
    local_mode: bool = key(False, "true: serve without tokens, on a loopback address only")
    max_body_bytes: int = key(4 * 1024 * 1024, "largest request body accepted (413 above)", **POSITIVE)
    max_ids_per_request: int = key(100000, "most ack entries (ids or runs) in one request", **POSITIVE)
    max_items_per_add: int = key(10000000, "most items in one add request", **POSITIVE)
    rate_limit: float = key(200.0, "requests per second per token (token bucket)", ge=0, note="0 = off")
    rate_burst: int = key(400, "token bucket size: requests a token may send at once", **POSITIVE)
    long_poll_max: float = key(60.0, "longest completion long-poll wait a client may ask for, seconds", **POSITIVE)
    max_waits_per_token: int = key(
        32, "long-polls and event streams one token may hold open at once (429 past it)", **POSITIVE
    )
    header_timeout: float = key(
        10.0,
        "seconds a connection has to send a request's headers (from connect, or the end of the last response); "
        "then it is closed",
        **POSITIVE,
    )
    body_timeout: float = key(
        30.0,
        "seconds a request has to send its body once its headers are in; then the connection is closed",
        **POSITIVE,
    )
    idempotency_window: float = key(
        86400.0,
        "seconds an Idempotency-Key's answer is kept for retries (expired keys are deleted in chunks)",
        **POSITIVE,
    )
    completion_poll_interval: float = key(
        0.25, "how often the server checks the batches long-polls wait on, seconds", **POSITIVE
    )
    pool_size: int = key(8, "database connections of the HTTP server", **POSITIVE)
    request_timeout: float = key(30.0, "longest database call of one request, seconds (503 after)", **POSITIVE)
    tls_certfile: str = key(
        "", "PEM certificate chain: serve HTTPS (with tls_keyfile); empty: plain HTTP behind a TLS proxy"
    )
    tls_keyfile: str = key("", "PEM private key of tls_certfile")
    forwarded_allow_ips: str = key("127.0.0.1", "proxies whose X-Forwarded-For / X-Forwarded-Proto headers are trusted")
    shutdown_timeout: float = key(10.0, "on SIGTERM, seconds to let in-flight requests finish", **POSITIVE)
    backend: str = key(
        "tracker",
        "tracker (the tracker's asyncio face) or sql (the SQL functions, as other languages call them)",
        choices=("tracker", "sql"),
    )


@dataclass
class ConsoleConfig:
    """The operator's console: web pages under /console/ of `reaper serve` (harvester/services/console/)."""

    enabled: bool = key(True, "serve the console under /console/ of `reaper serve`")
    run: bool = key(False, "also serve the console from `reaper run`, on console.host:console.port")
    host: str = key("127.0.0.1", "`reaper run` with console.run: address the console listens on")
    port: int = key(8401, "`reaper run` with console.run: TCP port of the console", gt=0, le=65535)
    viewer_tokens: str = key(
        "",
        "read-only console tokens, comma-separated (the tokens of http.tokens and http.tenants_file may also act)",
        secret=True,
    )
    viewer_tokens_file: str = key("", "file of read-only console tokens, one per line ('#' starts a comment)")
    session_secret: str = key(
        "",
        "key signing console session cookies (32+ characters); empty: a random key per process, so a restart "
        "logs everyone out (set it when several servers share one address)",
        secret=True,
    )
    session_ttl: float = key(43200.0, "seconds a console login lasts", **POSITIVE)
    refresh_interval: float = key(5.0, "seconds between the live updates of an open page", **POSITIVE)
    kafka_timeout: float = key(2.0, "seconds the overview waits for Kafka (leaders, acker lag)", **POSITIVE)
    metrics_urls: str = key(
        "",
        "reapers' /metrics URLs, comma-separated: the overview reads publish rates, refused marks and the "
        "sweeper's and settler's last runs from them",
    )
    page_size: int = key(50, "rows per page of the batch and dead-row lists", gt=0, le=1000)


@dataclass
class Config:
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    harvester: HarvesterConfig = field(default_factory=HarvesterConfig)
    acker: AckerConfig = field(default_factory=AckerConfig)
    sweeper: SweeperConfig = field(default_factory=SweeperConfig)
    settler: SettlerConfig = field(default_factory=SettlerConfig)
    inbox: InboxConfig = field(default_factory=InboxConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    console: ConsoleConfig = field(default_factory=ConsoleConfig)


# ------------------------------------------------------------------ what the schema derives


@functools.cache
def settings() -> tuple[Setting, ...]:
    """Every configuration key, in the order of the sections and their fields."""
    out = []
    defaults = Config()
    for section in dataclasses.fields(Config):
        obj = getattr(defaults, section.name)
        hints = get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            kind = get_origin(hints[f.name]) or hints[f.name]
            out.append(Setting(section.name, f.name, kind, getattr(obj, f.name), f.metadata["rule"]))
    return tuple(out)


def sections() -> dict[str, dict[str, Setting]]:
    out: dict[str, dict[str, Setting]] = {}
    for s in settings():
        out.setdefault(s.section, {})[s.name] = s
    return out


def redacted(cfg: Config) -> dict[str, dict[str, Any]]:
    """The whole configuration as plain data, secrets hidden: for logs and for showing it."""
    out: dict[str, dict[str, Any]] = {}
    for s in settings():
        out.setdefault(s.section, {})[s.name] = s.redact(getattr(getattr(cfg, s.section), s.name))
    return out


# ------------------------------------------------------------------ loading


def _apply(section_obj: Any, section: str, values: Mapping[str, Any]) -> None:
    known = sections()[section]
    for name, written in values.items():
        s = known.get(name)
        if s is None:
            raise ConfigError(f"{section}.{name}", f"unknown key (known: {', '.join(sorted(known))})")
        value = s.coerce(written)
        if s.is_mapping:
            value = {**getattr(section_obj, name), **value}
        else:
            s.check(value, written)
        setattr(section_obj, name, value)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the offending line: it may hold a password."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    mappings = {(s.section, s.name) for s in settings() if s.is_mapping}
    out: dict[str, dict[str, Any]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        section = parts[0]
        if len(parts) == 2:
            out.setdefault(section, {})[parts[1]] = value
        elif len(parts) == 3 and (section, parts[1]) in mappings:
            # REAPER_KAFKA__CLIENT__SASL_USERNAME -> sasl.username
            out.setdefault(section, {}).setdefault(parts[1], {})[parts[2].replace("_", ".")] = value
        else:
            raise ConfigError(name, "environment override must be REAPER_<SECTION>__<KEY>")
    return out


def load(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Build the configuration: defaults < YAML file < environment < explicit overrides."""
    cfg = Config()
    layers: list[Mapping[str, Any]] = []
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except FileNotFoundError:
            raise ConfigError("--config", f"file not found: {path}") from None
        except yaml.YAMLError as exc:
            raise ConfigError("--config", f"{path} is not valid YAML: {_yaml_problem(exc)}") from None
        if not isinstance(data, Mapping):
            raise ConfigError("--config", f"{path} must hold a mapping of sections")
        layers.append(data)
    layers.append(_env_overrides(os.environ if environ is None else environ))
    if overrides:
        layers.append(overrides)
    known = sections()
    for layer in layers:
        for section, values in layer.items():
            if section not in known:
                raise ConfigError(section, f"unknown section (known: {', '.join(sorted(known))})")
            if not isinstance(values, Mapping):
                raise ConfigError(section, "must be a mapping")
            _apply(getattr(cfg, section), section, values)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Every key's own rule (for a Config built in code too), then the rules relating keys."""
    for s in settings():
        value = getattr(getattr(cfg, s.section), s.name)
        if not s.is_mapping:
            s.check(s.coerce(value))
    _check_relations(cfg)


def _check_relations(cfg: Config) -> None:
    if cfg.harvester.trace_spans:
        from tracker import tracing

        if not tracing.enabled():
            raise ConfigError("harvester.trace_spans", "needs OpenTelemetry: pip install 'outbox-reaper[otel]'")
    if cfg.harvester.heartbeat_timeout >= cfg.harvester.session_timeout:
        raise ConfigError(
            "harvester.heartbeat_timeout",
            "must be shorter than harvester.session_timeout, so a cut-off leader fences itself "
            "before the group can hand its partition to another",
        )
    if 0 < cfg.harvester.step_down_after < STEP_DOWN_MIN:
        raise ConfigError(
            "harvester.step_down_after",
            f"{cfg.harvester.step_down_after:g} is 0 (never step down) or at least {STEP_DOWN_MIN:g} s: a database "
            "restart fails marks for a moment, and that alone must not hand leadership over",
        )
    if cfg.database.pool_size < cfg.harvester.purge_workers + 2:
        raise ConfigError(
            "database.pool_size",
            f"{cfg.database.pool_size} is too small: the harvester needs "
            f"harvester.purge_workers + 2 = {cfg.harvester.purge_workers + 2} connections (mark, purge, upkeep)",
        )
    for name in ("retention", "ahead"):
        if getattr(cfg.inbox, name) / cfg.inbox.bucket > 1000:
            raise ConfigError(
                f"inbox.{name}",
                f"{getattr(cfg.inbox, name):g} spans more than 1000 partitions of inbox.bucket = {cfg.inbox.bucket:g} s",
            )
    if cfg.harvester.mark_batch > cfg.harvester.max_in_flight:
        raise ConfigError("harvester.mark_batch", "must not exceed harvester.max_in_flight")
    for section in ("client", "producer"):
        for k, v in getattr(cfg.kafka, section).items():
            if k in REQUIRED_PRODUCER and str(v).lower() != str(REQUIRED_PRODUCER[k]).lower():
                raise ConfigError(
                    f"kafka.{section}.{k}",
                    f"reaper sets {k}={REQUIRED_PRODUCER[k]!r} itself to keep "
                    "per-key order across failures; remove this setting",
                )
    for section in ("client", "producer", "consumer"):
        for k, v in getattr(cfg.kafka, section).items():
            if isinstance(v, (Mapping, list)):
                inner = f"{k}.{next(iter(v))}" if isinstance(v, Mapping) and v else f"{k}.<name>"
                raise ConfigError(
                    f"kafka.{section}.{k}",
                    f"librdkafka settings are single values under their dotted names (e.g. {inner}: ...), "
                    "not nested mappings or lists",
                )
            if k in RESERVED_KAFKA:
                raise ConfigError(
                    f"kafka.{section}.{k}",
                    "is set by reaper itself; use kafka.bootstrap_servers or the harvester/acker group keys",
                )
            if k == "transactional.id":
                raise ConfigError(f"kafka.{section}.{k}", "is set by reaper itself; use harvester.transactional_id")
    if bool(cfg.http.tls_certfile) != bool(cfg.http.tls_keyfile):
        raise ConfigError("http.tls_certfile", "set both http.tls_certfile and http.tls_keyfile, or neither")
    units(cfg)  # raises ConfigError naming the offending outbox key
    read_by_ackers = {*ack_topics(cfg).values(), cfg.acker.dead_letter_topic}  # ... and the offending ack_topic
    # events the reaper writes, or leadership records, on a topic an acker reads would be read as acks
    for section, name in (
        ("harvester", "default_completion_topic"),
        ("sweeper", "expiry_topic"),
        ("harvester", "leader_topic"),
    ):
        topic = getattr(getattr(cfg, section), name)
        if topic in read_by_ackers:
            raise ConfigError(f"{section}.{name}", f"{topic!r} is an ack topic or the acks' dead-letter topic")


# ------------------------------------------------------------------ harvest units

_OUTBOX_KEYS = set(OutboxEntry.__annotations__)


@dataclass(frozen=True)
class UnitSpec:
    """One harvest unit: lane `lane` of `lanes` of one outbox table. `index` is its leader-topic partition."""

    index: int
    outbox: str
    dsn: str
    schema: str
    table: str
    lane: int
    lanes: int

    @property
    def name(self) -> str:
        return self.outbox if self.lanes == 1 else f"{self.outbox}.{self.lane}"


def units(cfg: Config) -> list[UnitSpec]:
    """The harvest units of a configuration, in leader-topic partition order (validated)."""
    h, db = cfg.harvester, cfg.database
    entries: list[Any] = h.outboxes or [OutboxEntry(name="default", lanes=h.lanes)]
    if h.outboxes and h.lanes != 1:
        raise ConfigError("harvester.lanes", "applies only when harvester.outboxes is empty; set lanes per outbox")
    out: list[UnitSpec] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        key = f"harvester.outboxes[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(key, f"expected a mapping with keys {sorted(_OUTBOX_KEYS)}, got {redact(key, entry)!r}")
        unknown = set(entry) - _OUTBOX_KEYS
        if unknown:
            raise ConfigError(f"{key}.{sorted(unknown)[0]}", f"unknown key (known: {', '.join(sorted(_OUTBOX_KEYS))})")
        name = entry.get("name", f"outbox{i}")
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9_-]{1,40}$", name):
            raise ConfigError(f"{key}.name", f"{name!r} must be 1-40 of A-Z a-z 0-9 _ -")
        if name in seen:
            raise ConfigError(f"{key}.name", f"{name!r} is listed twice")
        seen.add(name)
        schema, table = entry.get("schema", db.schema), entry.get("table", db.outbox_table)
        for what, value in (("schema", schema), ("table", table)):
            try:
                check_identifier(value, what)
            except (InvalidIdentifier, TypeError) as exc:
                raise ConfigError(f"{key}.{what}", str(exc)) from None
        dsn = entry.get("dsn", db.dsn)
        dsn_key = f"{key}.dsn" if "dsn" in entry else "database.dsn"
        if not isinstance(dsn, str) or not dsn:
            raise ConfigError(dsn_key, "must be a non-empty libpq URI or key=value string")
        try:
            conninfo_to_dict(dsn)
        except psycopg.Error as exc:
            raise ConfigError(dsn_key, f"not a libpq URI or key=value string: {redact_dsn(str(exc)).strip()}") from None
        lanes = entry.get("lanes", 1)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            lanes_key = "harvester.lanes" if not h.outboxes else f"{key}.lanes"
            raise ConfigError(lanes_key, f"{lanes!r} must be an integer from 1 to {MAX_LANES}")
        for lane in range(lanes):
            out.append(UnitSpec(len(out), name, dsn, schema, table, lane, lanes))
    if len(out) > MAX_UNITS:
        raise ConfigError("harvester.outboxes", f"{len(out)} units: at most {MAX_UNITS}")
    return out


def acker_group(cfg: Config, topic: str) -> str:
    """The consumer group of the acker of `topic`: acker.group for acker.topic (the `database`
    section's schema), `<acker.group>-<topic>` for another schema's ack topic."""
    return cfg.acker.group if topic == cfg.acker.topic else f"{cfg.acker.group}-{topic}"


def ack_topics(cfg: Config) -> dict[tuple[str, str], str]:
    """The ack topic of each (dsn, schema) of the configuration's outboxes that has one (validated):
    acker.topic for the `database` section's, and for another schema the ack_topic its entries of
    harvester.outboxes set (those that set one must agree). A topic acks one schema only: batch ids
    are per schema, so an id read from one schema's topic means nothing in another."""
    db = cfg.database
    out = {(db.dsn, db.schema): cfg.acker.topic}
    owner = {cfg.acker.topic: (db.dsn, db.schema)}
    for i, entry in enumerate(cfg.harvester.outboxes):
        if not isinstance(entry, Mapping) or "ack_topic" not in entry:
            continue
        where, topic = f"harvester.outboxes[{i}].ack_topic", entry["ack_topic"]
        if not isinstance(topic, str):
            raise ConfigError(where, f"expected a Kafka topic name, got {topic!r}")
        problem = TOPIC.problem(topic)
        if problem:
            raise ConfigError(where, problem)
        target = (entry.get("dsn", db.dsn), entry.get("schema", db.schema))
        if target == (db.dsn, db.schema) and topic != cfg.acker.topic:
            raise ConfigError(
                where,
                f"{topic!r}: the `database` section's schema {db.schema!r} acks on acker.topic "
                f"({cfg.acker.topic!r}); leave ack_topic out or set it to that",
            )
        if target in out and out[target] != topic:
            raise ConfigError(
                where, f"{topic!r} disagrees with {out[target]!r}, the ack topic of schema {target[1]!r} set before"
            )
        if topic == cfg.acker.dead_letter_topic:
            raise ConfigError(where, f"{topic!r} is acker.dead_letter_topic")
        if owner.get(topic, target) != target:
            raise ConfigError(
                where, f"{topic!r} is already the ack topic of schema {owner[topic][1]!r}: a topic acks one schema"
            )
        out[target], owner[topic] = topic, target
    return out
