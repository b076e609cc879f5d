"""`reaper` configuration: a YAML file, then environment-variable overrides, then validation.

Every key has a default; `REAPER_<SECTION>__<KEY>` overrides `<section>.<key>` (e.g.
`REAPER_DATABASE__DSN`, `REAPER_HARVESTER__HEARTBEAT_TIMEOUT`). Kafka client settings under
`kafka.client` are passed to librdkafka as they are (`REAPER_KAFKA__CLIENT__SASL_PASSWORD` sets
`sasl.password`), and checked by librdkafka itself at load. A bad value fails at start with a
ConfigError naming the key and the value; so does a variable that starts like one
(`REAPER_DATABASE_SCHEMA`, one underscore) or names no key (`REAPER_KAFKA__CLIENT__`,
`REAPER_HARVESTER__SESION_TIMEOUT`: named as written, with the key it was read as). The file is
read by harvester.config_yaml.load_yaml's rules: at most MAX_CONFIG_BYTES of UTF-8, no aliases,
no key written twice in one mapping.

The schema is written once, in harvester.config_keys: each key is a dataclass field whose type and
default are the field's, and whose rule (description, bounds, allowed values, secrecy) is
`key(...)`'s metadata (the vocabulary is harvester.config_schema). Coercion, the per-key checks, the
environment-variable names, the redaction of secrets and the configuration reference
(deploy/config_reference.py) are all derived from it, here. Checks that relate two keys are written
out in `_check_relations`; the harvest units and ack topics of harvester.outboxes are read in
harvester.config_outboxes; the Kafka client settings (what reaper sets itself, and librdkafka's own
verdict on the rest) in harvester.config_kafka. This module is the configuration's one import path: the classes and
functions of both are taken from here.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_origin, get_type_hints

from harvester.config_errors import ConfigError, clip  # noqa: F401  (ConfigError: importers use it from here)
from harvester.config_kafka import REQUIRED_PRODUCER, RESERVED_KAFKA, check_kafka  # noqa: F401  (importers use them from here)
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
from harvester.config_schema import ENV_PREFIX, Setting
from harvester.config_yaml import load_yaml
from harvester.redaction import redact, redact_dsn  # noqa: F401  (importers use them from here)

# harvester.step_down_after's smallest non-zero value: a database restart fails marks for a moment
STEP_DOWN_MIN = 1.0

# The largest configuration file read: a configuration is a few kilobytes, and YAML is slow to read
# (a 9 MB file took 40 s and 900 MB).
MAX_CONFIG_BYTES = 1 << 20


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


def _apply(section_obj: Any, section: str, values: Mapping[str, Any], variables: Mapping[str, str]) -> None:
    """`values` of `section` onto `section_obj`; `variables`: the environment variable each came
    from (by key name), named in place of the key a user never wrote."""
    known = sections()[section]
    for name, written in values.items():
        s = known.get(name)
        if s is None:
            problem = f"unknown key (known: {', '.join(sorted(known))})"
            if name in variables:  # a misspelled variable: named as written, and the key it was read as
                near = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {ENV_PREFIX}{section.upper()}__{near[0].upper()}?)" if near else ""
                raise ConfigError(variables[name], f"is read as {clip(f'{section}.{name}', 80)}, an {problem}{hint}")
            raise ConfigError(clip(f"{section}.{name}", 80), problem)
        value = s.coerce(written)
        if s.is_mapping:
            value = {**getattr(section_obj, name), **value}
        else:
            s.check(value, written)
        setattr(section_obj, name, value)


def _env_overrides(
    environ: Mapping[str, str], variables: dict[str, dict[str, str]] | None = None
) -> dict[str, dict[str, Any]]:
    """The REAPER_ variables of `environ` as sections of keys; `variables` (if given) is filled with
    the variable each key came from, by section and key name."""
    known = sections()
    mappings = {(s.section, s.name) for s in settings() if s.is_mapping}
    out: dict[str, dict[str, Any]] = {}
    origin: dict[tuple[str, ...], str] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        if "__" not in rest:
            # REAPER_DATABASE_SCHEMA: a configuration variable with one underscore too few. Others
            # (REAPER_FAULT_INJECTION, Kubernetes' REAPER_HTTP_PORT for a service named reaper-http)
            # belong to someone else.
            section = next((s for s in known if rest == s or rest.startswith(f"{s}_")), None)
            if section is not None and not _KUBERNETES_SERVICE_VARIABLE.search(name):
                wanted = f"{ENV_PREFIX}{section.upper()}__{rest[len(section) + 1 :].upper() or '<KEY>'}"
                raise ConfigError(
                    name, f"is not a configuration variable: write {wanted} (two underscores after the section)"
                )
            continue
        parts = rest.split("__")
        if "" in parts or not 2 <= len(parts) <= 3:
            raise ConfigError(
                name, "environment override must be REAPER_<SECTION>__<KEY> (or REAPER_KAFKA__<PART>__<NAME>)"
            )
        section = parts[0]
        if section not in known:
            raise ConfigError(name, f"unknown section {section!r} (known: {', '.join(sorted(known))})")
        if len(parts) == 2:
            where: tuple[str, ...] = (section, parts[1])
            out.setdefault(section, {})[parts[1]] = value
            if variables is not None:
                variables.setdefault(section, {})[parts[1]] = name
        elif (section, parts[1]) in mappings:
            # REAPER_KAFKA__CLIENT__SASL_USERNAME -> sasl.username
            entry = parts[2].replace("_", ".")
            where = (section, parts[1], entry)
            out.setdefault(section, {}).setdefault(parts[1], {})[entry] = value
        else:
            raise ConfigError(name, f"{section}.{parts[1]} is not a mapping: write REAPER_<SECTION>__<KEY>")
        if where in origin:
            raise ConfigError(name, f"sets {'.'.join(where)}, which {origin[where]} sets too")
        origin[where] = name
    return out


# the variables Kubernetes sets for each service of the namespace (a service named reaper-http:
# REAPER_HTTP_SERVICE_HOST, REAPER_HTTP_PORT_8400_TCP_ADDR, ...)
_KUBERNETES_SERVICE_VARIABLE = re.compile(r"_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_\w+)?)?)$")


def _read(path: str | Path) -> Any:
    """The configuration file's YAML: a ConfigError naming --config when it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError("--config", f"{path} is a directory, not a file") from None
    except OSError as exc:
        raise ConfigError("--config", f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError("--config", f"{path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: not a configuration file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise ConfigError("--config", f"{path} is not UTF-8 text (an invalid byte at line {line})") from None
    try:
        return load_yaml(text, "--config")
    except ConfigError as exc:  # name the file too
        raise ConfigError("--config", f"{path} is {exc.problem}") from None


def load(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Build the configuration: defaults < YAML file < environment < explicit overrides."""
    cfg = Config()
    layers: list[tuple[Mapping[str, Any], Mapping[str, Mapping[str, str]]]] = []  # with each key's variable
    if path is not None:
        data = _read(path) or {}
        if not isinstance(data, Mapping):
            raise ConfigError("--config", f"{path} must hold a mapping of sections")
        layers.append((data, {}))
    variables: dict[str, dict[str, str]] = {}
    layers.append((_env_overrides(os.environ if environ is None else environ, variables), variables))
    if overrides:
        layers.append((overrides, {}))
    known = sections()
    for layer, names in layers:
        for section, values in layer.items():
            if section not in known:
                raise ConfigError(clip(str(section), 80), f"unknown section (known: {', '.join(sorted(known))})")
            if not isinstance(values, Mapping):
                raise ConfigError(section, "must be a mapping")
            _apply(getattr(cfg, section), section, values, names.get(section, {}))
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
    # A run makes partitions past now + ahead, and the next comes `interval` later (or two, when
    # one is skipped: a busy lock, the database away): a shorter ahead leaves now without a
    # partition, and every claim fails with NoInboxPartition, until that run. The partitions' span
    # (bucket) adds nothing: the last one made ends past now + ahead whatever it is.
    if cfg.inbox.enabled and cfg.inbox.ahead < 2 * cfg.inbox.interval:
        raise ConfigError(
            "inbox.ahead",
            f"{cfg.inbox.ahead:.15g} must be at least 2 x inbox.interval = {2 * cfg.inbox.interval:.15g} s: partitions "
            "made this far ahead must outlast the wait for the next maintenance run, and one more if a run is skipped",
        )
    if cfg.harvester.mark_batch > cfg.harvester.max_in_flight:
        raise ConfigError("harvester.mark_batch", "must not exceed harvester.max_in_flight")
    check_kafka(cfg)
    if 1 < cfg.http.pool_size <= cfg.http.max_connections_per_tenant:
        raise ConfigError(
            "http.max_connections_per_tenant",
            f"{cfg.http.max_connections_per_tenant} must be below http.pool_size = {cfg.http.pool_size}, so that "
            "while one tenant's requests are stuck another tenant still finds a connection (0: pool_size - 1)",
        )
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
