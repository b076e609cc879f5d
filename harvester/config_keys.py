"""The `reaper` configuration's keys: one dataclass per section, one field per key.

The schema is written once, here: each key's type and default are its field's, and its rule
(description, bounds, allowed values, secrecy) is `key(...)`'s metadata (the vocabulary is
harvester.config_schema). Loading, the checks that relate two keys and what else derives from the
keys are in harvester.config, which is also where importers take these classes from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypedDict

from harvester.config_schema import TOPIC, Check, key
from tracker.schema import MAX_OUTBOX_TABLE_BYTES, MAX_SCHEMA_BYTES

MAX_LANES = 64
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
        # room for its roles' names, `<schema>_consumer` and the like (tracker.roles)
        check=Check(f"SQL identifier of at most {MAX_SCHEMA_BYTES} bytes", identifier="schema"),
    )
    outbox_table: str = key(
        "outbox",
        "name of the outbox table in that schema",
        # room for its dead-row table's name, `<table>_dead`
        check=Check(f"SQL identifier of at most {MAX_OUTBOX_TABLE_BYTES} bytes", identifier="outbox table"),
    )
    pool_size: int = key(
        6, "database connections of one reaper (mark, purge workers, upkeep, acker, sweeper)", **POSITIVE, le=1000
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
    min_poll_interval: float = key(0.1, "seconds between the leader's heartbeats", **POSITIVE, le=60)
    heartbeat_timeout: float = key(
        5.0, "a leader that sees none of its heartbeats for this long fences itself (seconds)", **POSITIVE, le=300
    )
    session_timeout: float = key(
        15.0,
        "leader-group session timeout (seconds); must exceed heartbeat_timeout and lie within the brokers' "
        "group.min.session.timeout.ms and group.max.session.timeout.ms (checked at start). The election's Kafka "
        "clients wait as long on a broker that does not answer, and librdkafka waits at most 300 s",
        **POSITIVE,
        le=300,
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
    mark_batch: int = key(5000, "rows claimed by one mark query", **POSITIVE, le=1_000_000)
    max_in_flight: int = key(20000, "records produced and awaiting their delivery reports", **POSITIVE, le=10_000_000)
    mark_deadline: float = key(
        5.0, "a mark-and-produce cycle longer than this forces a remark (seconds)", **POSITIVE, le=3600
    )
    idle_poll_interval: float = key(0.005, "pause after a mark that found nothing (seconds)", **POSITIVE, le=60)
    purge_batch: int = key(5000, "rows deleted by one purge statement", **POSITIVE, le=1_000_000)
    purge_workers: int = key(2, "connections purging delivered rows in parallel", **POSITIVE, le=64)
    vacuum_interval: float = key(
        2.0,
        "the leader (of lane 0, with lanes) vacuums the outbox this often while rows are purged from it (seconds)",
        ge=0,
        le=86400,
        note="0 = autovacuum only",
    )
    drain_timeout: float = key(10.0, "on shutdown, wait this long for in-flight records (seconds)", **POSITIVE, le=3600)
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
    max_poll_records: int = key(100000, "acks folded into one round of masked UPDATEs", **POSITIVE, le=1_000_000)
    poll_timeout: float = key(0.2, "seconds one poll waits for ack messages", **POSITIVE, le=60)


@dataclass
class SweeperConfig:
    enabled: bool = key(True, "run the sweeper (expiry and retention) in this process")
    interval: float = key(30.0, "seconds between sweeps", **POSITIVE, le=86400)
    idle_expiry: float = key(
        86400.0,
        "expire open and closed batches with no add, close or ack for this long (seconds)",
        **POSITIVE,
        le=3660 * 86400,
    )
    retention: float = key(
        7 * 86400.0,
        "delete complete and expired batches this long after they finished (seconds)",
        **POSITIVE,
        le=3660 * 86400,
    )
    chunk: int = key(1000, "batches handled per sweep statement", **POSITIVE, le=1_000_000)
    expiry_topic: str = key(
        "",
        "topic of expiry events (one per expired batch); empty = the batch's completion topic",
        check=dataclasses.replace(TOPIC, allowed="empty, or a Kafka topic name", optional=True),
    )


@dataclass
class InboxConfig:
    """The inbox's partitions (tracker.inbox): made ahead of time, dropped whole once expired."""

    enabled: bool = key(True, "run the inbox maintenance in this process (safe with several reapers)")
    interval: float = key(60.0, "seconds between inbox maintenance runs", **POSITIVE, le=86400)
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
    ahead: float = key(
        3 * 86400.0,
        "make inbox partitions this far ahead of time (seconds); at least 2 x inbox.interval, so a skipped "
        "maintenance run leaves no time without a partition",
        ge=0,
        le=366 * 86400,
    )
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
        le=3600,
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
    backlog_interval: float = key(5.0, "seconds between the backlog and batch-table gauge queries", **POSITIVE, le=3600)


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
    max_body_bytes: int = key(4 * 1024 * 1024, "largest request body accepted (413 above)", **POSITIVE, le=1 << 30)
    max_ids_per_request: int = key(100000, "most ack entries (ids or runs) in one request", **POSITIVE, le=10_000_000)
    max_items_per_add: int = key(10000000, "most items in one add request", **POSITIVE, le=1 << 30)
    rate_limit: float = key(200.0, "requests per second per token (token bucket)", ge=0, note="0 = off")
    rate_burst: int = key(400, "token bucket size: requests a token may send at once", **POSITIVE, le=1_000_000)
    long_poll_max: float = key(
        60.0, "longest completion long-poll wait a client may ask for, seconds", **POSITIVE, le=3600
    )
    max_waits_per_token: int = key(
        32, "long-polls and event streams one token may hold open at once (429 past it)", **POSITIVE, le=100_000
    )
    header_timeout: float = key(
        10.0,
        "seconds a connection has to send a request's headers (from connect, or the end of the last response), "
        "and to finish its TLS handshake; then it is closed",
        **POSITIVE,
        le=3600,
    )
    body_timeout: float = key(
        30.0,
        "seconds a request has to send its body once its headers are in; then the connection is closed",
        **POSITIVE,
        le=3600,
    )
    idempotency_window: float = key(
        86400.0,
        "seconds an Idempotency-Key's answer is kept for retries (expired keys are deleted in chunks)",
        **POSITIVE,
        le=366 * 86400,
    )
    completion_poll_interval: float = key(
        0.25, "how often the server checks the batches long-polls wait on, seconds", **POSITIVE, le=60
    )
    pool_size: int = key(8, "database connections of the HTTP server", **POSITIVE, le=1000)
    max_connections_per_tenant: int = key(
        0,
        "database connections one tenant's requests (all its tokens together) may use at once, below pool_size "
        "so another tenant always finds one; 0: pool_size - 1. More wait for one, 429 after request_timeout",
        ge=0,
        le=1000,
    )
    request_timeout: float = key(30.0, "longest database call of one request, seconds (503 after)", **POSITIVE, le=3600)
    tls_certfile: str = key(
        "", "PEM certificate chain: serve HTTPS (with tls_keyfile); empty: plain HTTP behind a TLS proxy"
    )
    tls_keyfile: str = key("", "PEM private key of tls_certfile")
    forwarded_allow_ips: str = key("127.0.0.1", "proxies whose X-Forwarded-For / X-Forwarded-Proto headers are trusted")
    shutdown_timeout: float = key(10.0, "on SIGTERM, seconds to let in-flight requests finish", **POSITIVE, le=3600)
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
    session_ttl: float = key(43200.0, "seconds a console login lasts", **POSITIVE, le=366 * 86400)
    refresh_interval: float = key(5.0, "seconds between the live updates of an open page", **POSITIVE, le=3600)
    kafka_timeout: float = key(2.0, "seconds the overview waits for Kafka (leaders, acker lag)", **POSITIVE, le=300)
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
