#!/usr/bin/env python3
"""The configuration reference, generated from harvester/config.py's dataclasses.

    .venv/bin/python deploy/config_reference.py          # rewrite deploy/reaper.example.yaml and README's table
    .venv/bin/python deploy/config_reference.py --check  # exit 1 if either is out of date

Keys, defaults and environment-variable names come from the code; the one-line descriptions
live here. A key without a description fails the run (and tests/test_deploy.py), so a new key
cannot ship undocumented.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harvester import config  # noqa: E402

EXAMPLE = REPO / "deploy" / "reaper.example.yaml"
README = REPO / "README.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"

DESCRIPTIONS = {
    "database.dsn": "libpq URI or key=value string of the database holding the outbox",
    "database.schema": "schema of the outbox, batch and batch_group tables (`reaper migrate` creates it)",
    "database.outbox_table": "name of the outbox table in that schema",
    "database.pool_size": "database connections of one reaper (mark, purge workers, upkeep, acker, sweeper)",
    "kafka.bootstrap_servers": "Kafka brokers, host:port[,host:port...]",
    "kafka.client": "librdkafka settings for every client (security.protocol, sasl.*, ssl.*, ...)",
    "kafka.producer": "librdkafka settings for the producer only, over kafka.client",
    "kafka.consumer": "librdkafka settings for the consumers only, over kafka.client",
    "harvester.enabled": "run the harvester (leader election and publishing) in this process",
    "harvester.leader_topic": "topic for leader election, one partition per harvest unit; the holder of partition u leads unit u",
    "harvester.leader_group": "consumer group of all instances of one deployment",
    "harvester.min_poll_interval": "seconds between the leader's heartbeats",
    "harvester.heartbeat_timeout": "a leader that sees none of its heartbeats for this long fences itself (seconds)",
    "harvester.session_timeout": "leader-group session timeout (seconds); must exceed heartbeat_timeout",
    "harvester.mark_batch": "rows claimed by one mark query",
    "harvester.max_in_flight": "records produced and awaiting their delivery reports",
    "harvester.mark_deadline": "a mark-and-produce cycle longer than this forces a remark (seconds)",
    "harvester.idle_poll_interval": "pause after a mark that found nothing (seconds)",
    "harvester.purge_batch": "rows deleted by one purge statement",
    "harvester.purge_workers": "connections purging delivered rows in parallel",
    "harvester.vacuum_interval": "the leader vacuums the outbox this often while it purges (seconds; 0 = autovacuum only)",
    "harvester.drain_timeout": "on shutdown, wait this long for in-flight records (seconds)",
    "harvester.transactional_id": "publish in Kafka transactions under this id (same on every instance; producers "
    "`<id>` and `<id>#1`, taken in turn): a new leader fences the old one at the broker; rows are purged after "
    "commit. Empty = off",
    "harvester.trace_spans": "emit an OpenTelemetry PRODUCER span per published row, linked to the trace context "
    "stored with it (needs the otel extra and a configured tracer provider)",
    "harvester.lanes": 'harvest units of the `database` outbox: rows are split by md5(key) mod lanes; change only by draining, then switching (README "Harvest units")',
    "harvester.outboxes": "outboxes to harvest, each {name, dsn, schema, table, lanes} (missing keys from `database`); empty: the `database` outbox",
    "harvester.lane_index": "with lanes > 1, build (CONCURRENTLY, by lane 0's leader) and mark through an index on "
    "(lane, id), so each lane reads only its own rows; costs each outbox insert one index entry",
    "harvester.default_completion_topic": "topic of completion events for batches opened without one",
    "acker.enabled": "run the acker (ack-topic consumer) in this process",
    "acker.topic": "topic consumers produce acks to, keyed by batch id",
    "acker.group": "consumer group of the ackers",
    "acker.dead_letter_topic": "rejected acks go here with the reason",
    "acker.max_poll_records": "acks folded into one round of masked UPDATEs",
    "acker.poll_timeout": "seconds one poll waits for ack messages",
    "settler.enabled": "run the settler: folds consumers' ack claims whose commit found the batch row busy",
    "settler.interval": "how often the settler looks for unsettled claims (seconds); bounds how long a completion "
    "can lag its last ack's commit",
    "sweeper.enabled": "run the sweeper (expiry and retention) in this process",
    "sweeper.interval": "seconds between sweeps",
    "sweeper.idle_expiry": "expire open and closed batches with no add, close or ack for this long (seconds)",
    "sweeper.retention": "delete complete and expired batches this long after they finished (seconds)",
    "sweeper.chunk": "batches handled per sweep statement",
    "sweeper.expiry_topic": "topic of expiry events (one per expired batch); empty = the batch's completion topic",
    "metrics.enabled": "serve /metrics, /healthz and /readyz",
    "metrics.host": "address the HTTP endpoint listens on",
    "metrics.port": "port of /metrics, /healthz and /readyz (0 = any free port)",
    "metrics.prefix": "prefix of the harvester's metric names",
    "metrics.backlog_interval": "seconds between the backlog and batch-table gauge queries",
    "logging.format": "json, console, or auto (console in a terminal, else json)",
    "logging.level": "debug, info, warning or error",
    "http.host": "`reaper serve`: address to listen on",
    "http.port": "`reaper serve`: TCP port",
    "http.tokens": "bearer tokens, comma-separated (prefer tokens_file); none: refuse to start unless local_mode",
    "http.tokens_file": "file of bearer tokens, one per line ('#' starts a comment)",
    "http.tenants_file": "YAML file of tenants: each one's token hashes (sha256:...) and allowed completion topics; re-read on change and on SIGHUP",
    "http.local_mode": "true: serve without tokens, on a loopback address only",
    "http.max_body_bytes": "largest request body accepted (413 above)",
    "http.max_ids_per_request": "most ack entries (ids or runs) in one request",
    "http.max_items_per_add": "most items in one add request",
    "http.rate_limit": "requests per second per token (token bucket); 0 = off",
    "http.rate_burst": "token bucket size: requests a token may send at once",
    "http.long_poll_max": "longest completion long-poll wait a client may ask for, seconds",
    "http.max_waits_per_token": "long-polls and event streams one token may hold open at once (429 past it)",
    "http.header_timeout": "seconds a connection has to send a request's headers (from connect, or the end of the last response); then it is closed",
    "http.idempotency_window": "seconds an Idempotency-Key's answer is kept for retries (expired keys are deleted in chunks)",
    "http.body_timeout": "seconds a request has to send its body once its headers are in; then the connection is closed",
    "http.completion_poll_interval": "how often the server checks the batches long-polls wait on, seconds",
    "http.pool_size": "database connections of the HTTP server",
    "http.request_timeout": "longest database call of one request, seconds (503 after)",
    "http.tls_certfile": "PEM certificate chain: serve HTTPS (with tls_keyfile); empty: plain HTTP behind a TLS proxy",
    "http.tls_keyfile": "PEM private key of tls_certfile",
    "http.forwarded_allow_ips": "proxies whose X-Forwarded-For / X-Forwarded-Proto headers are trusted",
    "http.shutdown_timeout": "on SIGTERM, seconds to let in-flight requests finish",
    "http.backend": "tracker (the tracker's asyncio face) or sql (the SQL functions, as other languages call them)",
}


@dataclasses.dataclass(frozen=True)
class Key:
    section: str
    name: str
    default: object

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"{config.ENV_PREFIX}{self.section.upper()}__{self.name.upper()}"

    @property
    def is_mapping(self) -> bool:
        return isinstance(self.default, dict)


def keys() -> list[Key]:
    out = []
    defaults = config.Config()
    for section in dataclasses.fields(defaults):
        obj = getattr(defaults, section.name)
        for f in dataclasses.fields(obj):
            out.append(Key(section.name, f.name, getattr(obj, f.name)))
    return out


def undocumented() -> list[str]:
    return [k.dotted for k in keys() if k.dotted not in DESCRIPTIONS]


def _yaml_scalar(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("...").strip()


def example_yaml() -> str:
    lines = [
        "# reaper configuration: every key with its default. Use with `reaper -c reaper.yaml run`.",
        "# Generated by deploy/config_reference.py from harvester/config.py; do not edit by hand.",
        "# Each key can be overridden by an environment variable REAPER_<SECTION>__<KEY>, e.g.",
        "# REAPER_DATABASE__DSN. librdkafka settings under kafka.client/producer/consumer take",
        "# REAPER_KAFKA__CLIENT__<NAME> with dots written as underscores (REAPER_KAFKA__CLIENT__SASL_PASSWORD",
        "# sets sasl.password).",
    ]
    section = None
    for k in keys():
        if k.section != section:
            section = k.section
            lines += ["", f"{section}:"]
        entry = f"  {k.name}: {_yaml_scalar(k.default)}"
        lines.append(f"{entry:<56}# {DESCRIPTIONS[k.dotted]}")
    return "\n".join(lines) + "\n"


def _md_default(k: Key) -> str:
    if k.is_mapping:
        return "`{}`"
    return f"`{_yaml_scalar(k.default)}`"


def reference_markdown() -> str:
    rows = ["| key | environment variable | default | meaning |", "|---|---|---|---|"]
    for k in keys():
        env = f"`{k.env}__<NAME>`" if k.is_mapping else f"`{k.env}`"
        rows.append(f"| `{k.dotted}` | {env} | {_md_default(k)} | {DESCRIPTIONS[k.dotted]} |")
    return "\n".join(rows)


def readme_with_reference(text: str) -> str:
    if START not in text or END not in text:
        raise SystemExit(f"README.md lacks the markers {START} ... {END}")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference_markdown()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    missing = undocumented()
    if missing:
        print(f"configuration keys without a description in {__file__}: {', '.join(missing)}", file=sys.stderr)
        return 1
    readme = README.read_text()
    wanted = {EXAMPLE: example_yaml(), README: readme_with_reference(readme)}
    stale = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if "--check" in argv:
        for p in stale:
            print(
                f"{p.relative_to(REPO)} is out of date: run .venv/bin/python deploy/config_reference.py",
                file=sys.stderr,
            )
        return 1 if stale else 0
    for p in stale:
        p.write_text(wanted[p])
        print(f"wrote {p.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
