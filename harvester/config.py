"""`reaper` configuration: a YAML file, then environment-variable overrides, then validation.

Every key has a default; `REAPER_<SECTION>__<KEY>` overrides `<section>.<key>` (e.g.
`REAPER_DATABASE__DSN`, `REAPER_HARVESTER__HEARTBEAT_TIMEOUT`). Kafka client settings under
`kafka.client` are passed to librdkafka as they are (`REAPER_KAFKA__CLIENT__SASL_PASSWORD` sets
`sasl.password`). A bad value fails at start with a ConfigError naming the key and the value.

The schema is written once, in harvester.config_keys: each key is a dataclass field whose type and
default are the field's, and whose rule (description, bounds, allowed values, secrecy) is
`key(...)`'s metadata (the vocabulary is harvester.config_schema). Coercion, the per-key checks, the
environment-variable names, the redaction of secrets and the configuration reference
(deploy/config_reference.py) are all derived from it, here. Checks that relate two keys are written
out in `_check_relations`; the harvest units and ack topics of harvester.outboxes are read in
harvester.config_outboxes. This module is the configuration's one import path: the classes and
functions of both are taken from here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_origin, get_type_hints

import yaml

from harvester.config_keys import (  # noqa: F401  (the sections and their constants: importers take them from here)
    MAX_LANES,
    POSITIVE,
    AckerConfig,
    Config,
    ConsoleConfig,
    DatabaseConfig,
    HarvesterConfig,
    HttpConfig,
    InboxConfig,
    KafkaConfig,
    LoggingConfig,
    MetricsConfig,
    OutboxEntry,
    SettlerConfig,
    SweeperConfig,
)
from harvester.config_outboxes import (  # noqa: F401  (importers take them from here)
    MAX_UNITS,
    UnitSpec,
    ack_topics,
    acker_group,
    units,
)
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

# Producer settings the harvester's per-key ordering rests on; configuration may not change them.
REQUIRED_PRODUCER = {
    "enable.idempotence": True,
    "message.timeout.ms": 0,  # no timeouts: they are the one failure that can leave a gap
    "enable.gapless.guarantee": True,  # any other gap-making failure is fatal: nothing after it is written
}
# librdkafka settings reaper sets itself; configuration may not name them.
RESERVED_KAFKA = ("bootstrap.servers", "group.id", "on_delivery", "error_cb", "on_commit")

# harvester.step_down_after's smallest non-zero value: a database restart fails marks for a moment
STEP_DOWN_MIN = 1.0


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
