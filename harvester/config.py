"""`reaper` configuration: a YAML file, then environment-variable overrides, then validation.

Every key has a default; `REAPER_<SECTION>__<KEY>` overrides `<section>.<key>` (e.g.
`REAPER_DATABASE__DSN`, `REAPER_HARVESTER__HEARTBEAT_TIMEOUT`). Kafka client settings under
`kafka.client` are passed to librdkafka as they are (`REAPER_KAFKA__CLIENT__SASL_PASSWORD` sets
`sasl.password`). A bad value fails at start with a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tracker.errors import InvalidIdentifier
from tracker.schema import check_identifier

ENV_PREFIX = "REAPER_"

# Producer settings the harvester's per-key ordering rests on; configuration may not change them.
REQUIRED_PRODUCER = {
    "enable.idempotence": True,
    "message.timeout.ms": 0,  # no timeouts: they are the one failure that can leave a gap
    "enable.gapless.guarantee": True,  # any other gap-making failure is fatal: nothing after it is written
}


class ConfigError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"configuration key {key!r}: {message}")


@dataclass
class DatabaseConfig:
    dsn: str = "postgresql://postgres@127.0.0.1:55432/outbox"
    schema: str = "reaper"
    outbox_table: str = "outbox"
    pool_size: int = 6


@dataclass
class KafkaConfig:
    bootstrap_servers: str = "127.0.0.1:59092"
    client: dict[str, Any] = field(default_factory=dict)  # passed through to every librdkafka client
    producer: dict[str, Any] = field(default_factory=dict)  # producer-only settings, over `client`
    consumer: dict[str, Any] = field(default_factory=dict)  # consumer-only settings, over `client`


@dataclass
class HarvesterConfig:
    enabled: bool = True
    leader_topic: str = "__reaper_leader"
    leader_group: str = "reaper"
    min_poll_interval: float = 0.1
    heartbeat_timeout: float = 5.0
    session_timeout: float = 15.0
    mark_batch: int = 5000
    max_in_flight: int = 20000
    mark_deadline: float = 5.0  # one mark + produce cycle longer than this forces a remark
    idle_poll_interval: float = 0.005  # sleep after a mark that found nothing
    purge_batch: int = 5000
    purge_workers: int = 2
    vacuum_interval: float = 2.0  # leader vacuums the outbox this often while it purges; 0 = autovacuum only
    drain_timeout: float = 10.0
    default_completion_topic: str = "batch-completions"
    # Set (the same value on every instance of one deployment) to publish in Kafka transactions: each
    # new leader's init_transactions fences the previous leader's producer at the broker, so even a
    # paused (SIGSTOP, frozen VM) old leader can write nothing after the takeover. Empty: off.
    transactional_id: str = ""
    # Emit an OpenTelemetry PRODUCER span per published row, linked to the trace context stored with
    # it (needs the `otel` extra; spans go to the process's global tracer provider).
    trace_spans: bool = False
    # Harvest units (README "Harvest units"): each outbox table is split into `lanes` units by a hash
    # of the key; every unit is led by one reaper at a time. `lanes` applies to the outbox of the
    # `database` section, used when `outboxes` is empty; `outboxes` lists several, each a mapping
    # {name, dsn, schema, table, lanes} whose missing keys come from `database` (lanes: 1).
    lanes: int = 1
    outboxes: list = field(default_factory=list)
    # With lanes > 1: build (CONCURRENTLY, by lane 0's leader) and mark through an index on (lane, id),
    # so each lane reads its own rows only (harvester.lane_index).
    lane_index: bool = True


@dataclass
class AckerConfig:
    enabled: bool = True
    topic: str = "acks"
    group: str = "reaper-acker"
    dead_letter_topic: str = "acks-dead-letter"
    max_poll_records: int = 100000
    poll_timeout: float = 0.2


@dataclass
class SweeperConfig:
    enabled: bool = True
    interval: float = 30.0
    idle_expiry: float = 86400.0
    retention: float = 7 * 86400.0
    chunk: int = 1000
    expiry_topic: str = ""  # expiry events go here; empty: each batch's completion topic


@dataclass
class SettlerConfig:
    """Issue 12: folds consumers' ack claims whose commit found the batch row busy (tracker.settle)."""

    enabled: bool = True
    interval: float = 0.01  # bounds how long a completion can lag its last ack's commit


@dataclass
class MetricsConfig:
    enabled: bool = True
    host: str = "0.0.0.0"
    port: int = 9400
    prefix: str = "reaper"
    backlog_interval: float = 5.0


@dataclass
class LoggingConfig:
    format: str = "auto"  # auto (console in a terminal, else json) | json | console
    level: str = "info"


@dataclass
class HttpConfig:
    """`reaper serve`: the tracker over HTTP (harvester/services/http/). Tokens: `tokens` (comma-separated)
    and/or `tokens_file` (one token per line, '#' comments); none = refuse to start unless local_mode."""

    host: str = "127.0.0.1"
    port: int = 8400
    tokens: str = ""
    tokens_file: str = ""
    tenants_file: str = ""  # YAML: tenants, their token hashes and completion topics (re-read on change)
    local_mode: bool = False  # no tokens, loopback only: a developer's machine
    max_body_bytes: int = 4 * 1024 * 1024
    max_ids_per_request: int = 100000  # ack entries (ids or runs) in one request
    max_items_per_add: int = 10000000  # items in one add request
    rate_limit: float = 200.0  # requests per second per token (token bucket); 0 = off
    rate_burst: int = 400
    long_poll_max: float = 60.0  # longest wait a completion long-poll may ask for, seconds
    max_waits_per_token: int = 32  # long-polls and event streams one token may hold open at once
    header_timeout: float = 10.0  # a connection sends its request's headers within this, seconds
    body_timeout: float = 30.0  # and then its body within this
    idempotency_window: float = 86400.0  # how long an Idempotency-Key's answer is kept, seconds
    completion_poll_interval: float = 0.25
    pool_size: int = 8
    request_timeout: float = 30.0  # one database call, seconds
    tls_certfile: str = ""  # both set: serve HTTPS; else put a TLS proxy in front (README)
    tls_keyfile: str = ""
    forwarded_allow_ips: str = "127.0.0.1"  # proxies whose X-Forwarded-For/-Proto are believed
    shutdown_timeout: float = 10.0
    backend: str = "tracker"  # tracker (the asyncio face) | sql (the SQL functions of sql/R__sql_api.sql)


@dataclass
class Config:
    database: DatabaseConfig = field(default_factory=DatabaseConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    harvester: HarvesterConfig = field(default_factory=HarvesterConfig)
    acker: AckerConfig = field(default_factory=AckerConfig)
    sweeper: SweeperConfig = field(default_factory=SweeperConfig)
    settler: SettlerConfig = field(default_factory=SettlerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    http: HttpConfig = field(default_factory=HttpConfig)


def _coerce(key: str, value: Any, target: type, default: Any) -> Any:
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
        if kind is dict:
            if not isinstance(value, Mapping):
                raise ValueError
            return {str(k): v for k, v in value.items()}
        if kind is list:
            if isinstance(value, str):  # from the environment: a YAML (or JSON) list
                value = yaml.safe_load(value)
            if not isinstance(value, list):
                raise ValueError
            return list(value)
    except (TypeError, ValueError):
        raise ConfigError(key, f"expected {kind.__name__}, got {redact(key, value)!r}") from None
    return value


_SECRET = re.compile(r"(password|secret|token|credential|sasl\.jaas|ssl\.key)", re.I)


def redact(key: str, value: Any) -> Any:
    """Hide secrets: values of secret-looking keys, and passwords inside DSNs."""
    if isinstance(value, str):
        if _SECRET.search(key):
            return "***"
        return redact_dsn(value)
    if isinstance(value, Mapping):
        return {k: redact(f"{key}.{k}", v) for k, v in value.items()}
    return value


def redact_dsn(text: str) -> str:
    text = re.sub(r"(://[^:/@\s]+:)[^@\s]*@", r"\1***@", text)
    return re.sub(r"(password\s*=\s*)('[^']*'|\S+)", r"\1***", text, flags=re.I)


def _apply(section_obj: Any, section: str, values: Mapping[str, Any]) -> None:
    fields = {f.name: f for f in dataclasses.fields(section_obj)}
    for key, value in values.items():
        full = f"{section}.{key}"
        if key not in fields:
            raise ConfigError(full, f"unknown key (known: {', '.join(sorted(fields))})")
        default = getattr(section_obj, key)
        if isinstance(default, dict) and isinstance(value, Mapping):
            merged = dict(default)
            merged.update(_coerce(full, value, dict, default))
            setattr(section_obj, key, merged)
        else:
            setattr(section_obj, key, _coerce(full, value, type(default), default))


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        section = parts[0]
        if len(parts) == 2:
            out.setdefault(section, {})[parts[1]] = value
        elif len(parts) == 3 and section == "kafka" and parts[1] in ("client", "producer", "consumer"):
            # REAPER_KAFKA__CLIENT__SASL_USERNAME -> sasl.username
            out.setdefault("kafka", {}).setdefault(parts[1], {})[parts[2].replace("_", ".")] = value
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
            raise ConfigError("--config", f"{path} is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError("--config", f"{path} must hold a mapping of sections")
        layers.append(data)
    layers.append(_env_overrides(os.environ if environ is None else environ))
    if overrides:
        layers.append(overrides)
    sections = {f.name for f in dataclasses.fields(cfg)}
    for layer in layers:
        for section, values in layer.items():
            if section not in sections:
                raise ConfigError(section, f"unknown section (known: {', '.join(sorted(sections))})")
            if not isinstance(values, Mapping):
                raise ConfigError(section, "must be a mapping")
            _apply(getattr(cfg, section), section, values)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    for key, value, what in (
        ("database.schema", cfg.database.schema, "schema"),
        ("database.outbox_table", cfg.database.outbox_table, "table"),
    ):
        try:
            check_identifier(value, what)
        except InvalidIdentifier as exc:
            raise ConfigError(key, str(exc)) from None
    topic = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
    for key in (
        "harvester.leader_topic",
        "acker.topic",
        "acker.dead_letter_topic",
        "harvester.default_completion_topic",
    ):
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not topic.match(value):
            raise ConfigError(key, f"{value!r} is not a valid Kafka topic name")
    if cfg.sweeper.expiry_topic and not topic.match(cfg.sweeper.expiry_topic):
        raise ConfigError("sweeper.expiry_topic", f"{cfg.sweeper.expiry_topic!r} is not a valid Kafka topic name")
    if cfg.harvester.trace_spans:
        from tracker import tracing

        if not tracing.enabled():
            raise ConfigError("harvester.trace_spans", "needs OpenTelemetry: pip install 'outbox-reaper[otel]'")
    txn_id = cfg.harvester.transactional_id
    if txn_id and not re.match(r"^[A-Za-z0-9._:-]{1,200}$", txn_id):
        raise ConfigError("harvester.transactional_id", f"{txn_id!r} must be 1-200 of A-Z a-z 0-9 . _ : -")
    positive = [
        "harvester.min_poll_interval",
        "harvester.heartbeat_timeout",
        "harvester.session_timeout",
        "harvester.mark_batch",
        "harvester.max_in_flight",
        "database.pool_size",
        "acker.max_poll_records",
        "harvester.mark_deadline",
        "harvester.idle_poll_interval",
        "harvester.purge_batch",
        "harvester.purge_workers",
        "harvester.drain_timeout",
        "sweeper.interval",
        "sweeper.idle_expiry",
        "sweeper.retention",
        "sweeper.chunk",
        "metrics.backlog_interval",
        "settler.interval",
    ]
    for key in positive:
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) <= 0:
            raise ConfigError(key, f"must be > 0, got {getattr(getattr(cfg, section), name)!r}")
    if cfg.harvester.heartbeat_timeout >= cfg.harvester.session_timeout:
        raise ConfigError(
            "harvester.heartbeat_timeout",
            "must be shorter than harvester.session_timeout, so a cut-off leader fences itself "
            "before the group can hand its partition to another",
        )
    if cfg.harvester.vacuum_interval < 0:
        raise ConfigError(
            "harvester.vacuum_interval", f"must be >= 0 (0 = autovacuum only), got {cfg.harvester.vacuum_interval!r}"
        )
    if cfg.database.pool_size < cfg.harvester.purge_workers + 2:
        raise ConfigError(
            "database.pool_size",
            f"{cfg.database.pool_size} is too small: the harvester needs "
            f"harvester.purge_workers + 2 = {cfg.harvester.purge_workers + 2} connections (mark, purge, upkeep)",
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
        for k in getattr(cfg.kafka, section):
            if k in ("bootstrap.servers", "group.id", "on_delivery", "error_cb", "on_commit"):
                raise ConfigError(
                    f"kafka.{section}.{k}",
                    "is set by reaper itself; use kafka.bootstrap_servers or the harvester/acker group keys",
                )
            if k == "transactional.id":
                raise ConfigError(f"kafka.{section}.{k}", "is set by reaper itself; use harvester.transactional_id")
    if not 0 <= cfg.metrics.port <= 65535:
        raise ConfigError("metrics.port", f"{cfg.metrics.port} is not a TCP port")
    if cfg.logging.format not in ("auto", "json", "console"):
        raise ConfigError("logging.format", f"{cfg.logging.format!r}: use auto, json or console")
    if cfg.logging.level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError("logging.level", f"{cfg.logging.level!r}: use debug, info, warning or error")
    validate_http(cfg.http)
    if not re.match(r"^[a-zA-Z_][a-zA-Z0-9_]*$", cfg.metrics.prefix):
        raise ConfigError("metrics.prefix", f"{cfg.metrics.prefix!r} is not a valid metric name prefix")
    units(cfg)  # raises ConfigError naming the offending outbox key


def validate_http(h: HttpConfig) -> None:
    for name in (
        "port",
        "max_body_bytes",
        "max_ids_per_request",
        "max_items_per_add",
        "rate_burst",
        "long_poll_max",
        "max_waits_per_token",
        "header_timeout",
        "body_timeout",
        "idempotency_window",
        "completion_poll_interval",
        "pool_size",
        "request_timeout",
        "shutdown_timeout",
    ):
        if getattr(h, name) <= 0:
            raise ConfigError(f"http.{name}", f"must be > 0, got {getattr(h, name)!r}")
    if h.port > 65535:
        raise ConfigError("http.port", f"{h.port} is not a TCP port")
    if h.rate_limit < 0:
        raise ConfigError("http.rate_limit", f"must be >= 0 (0 = off), got {h.rate_limit!r}")
    if h.backend not in ("tracker", "sql"):
        raise ConfigError("http.backend", f"{h.backend!r}: use tracker or sql")
    if bool(h.tls_certfile) != bool(h.tls_keyfile):
        raise ConfigError("http.tls_certfile", "set both http.tls_certfile and http.tls_keyfile, or neither")


MAX_LANES = 64
MAX_UNITS = 256
_OUTBOX_KEYS = {"name", "dsn", "schema", "table", "lanes"}


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
    entries = h.outboxes or [{"name": "default", "lanes": h.lanes}]
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
        if not isinstance(dsn, str) or not dsn:
            raise ConfigError(f"{key}.dsn", "must be a non-empty libpq URI or key=value string")
        lanes = entry.get("lanes", 1)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            lanes_key = "harvester.lanes" if not h.outboxes else f"{key}.lanes"
            raise ConfigError(lanes_key, f"{lanes!r} must be an integer from 1 to {MAX_LANES}")
        for lane in range(lanes):
            out.append(UnitSpec(len(out), name, dsn, schema, table, lane, lanes))
    if len(out) > MAX_UNITS:
        raise ConfigError("harvester.outboxes", f"{len(out)} units: at most {MAX_UNITS}")
    return out
