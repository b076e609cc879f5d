"""The Kafka client settings of a configuration (`kafka.client`, `kafka.producer`,
`kafka.consumer`): the ones reaper sets itself and that configuration may not change, the shape
librdkafka reads (one value per dotted name), and librdkafka's own verdict on every name and value,
alone and together with what reaper adds, at load rather than when a client is first made.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer

from harvester.config_errors import ConfigError, clip
from harvester.config_keys import Config
from harvester.election.timeouts import silent_broker_defaults, silent_broker_wait_ms
from harvester.redaction import redact, redact_dsn

# Producer settings the harvester's per-key ordering rests on; configuration may not change them.
REQUIRED_PRODUCER = {
    "enable.idempotence": True,
    "message.timeout.ms": 0,  # no timeouts: they are the one failure that can leave a gap
    "enable.gapless.guarantee": True,  # any other gap-making failure is fatal: nothing after it is written
}
# librdkafka settings reaper sets itself; configuration may not name them.
RESERVED_KAFKA = ("bootstrap.servers", "group.id", "on_delivery", "error_cb", "on_commit")


def check_kafka(cfg: Config) -> None:
    """The settings reaper owns are not set, each value is a single one, and librdkafka takes the
    rest: a ConfigError naming the offending key otherwise."""
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
    _check_with_librdkafka(cfg)


# ------------------------------------------------------------------ librdkafka's own checks

# A name librdkafka has no setting for, set after the configured ones: the constructor refuses it
# once it has accepted every setting before it, so librdkafka checks the names and values without
# a client being made (nothing connects, no file is read).
_PROBE = "reaper.configuration.probe"
# Not checked at load: librdkafka loads the plugins this names as soon as it is set.
_UNCHECKED_KAFKA = ("plugin.library.paths",)
# What the throwaway clients of _clients_refusal add: no broker (bootstrap.servers is not set), no
# TLS or SASL set-up (certificate files may exist only where `reaper run` runs), no log lines.
_discard = logging.getLogger("reaper.kafka.configuration-check")
_discard.addHandler(logging.NullHandler())
_discard.propagate = False
# (librdkafka raises log_level to debug when `debug` is set: it is left out, checked by _refusal.)
_QUIET = {"security.protocol": "plaintext", "log_level": 0, "logger": _discard}


def _refusal(conf: Mapping[str, Any]) -> str | None:
    """librdkafka's reason for refusing a name or a value of `conf`, or None."""
    try:
        client = Producer({**conf, _PROBE: "1"})
    except KafkaException as exc:
        reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
        return None if f'"{_PROBE}"' in reason else " ".join(reason.split())
    except Exception as exc:  # a value confluent_kafka cannot hand to librdkafka as text
        return f"{type(exc).__name__}: {exc}"
    client.flush(0)  # not reached: librdkafka has no such setting
    return None


def _kafka_problem(where: str, value: Any, reason: str) -> str:
    if reason.startswith("No such configuration property"):
        return "librdkafka has no such setting"
    if redact(where, "x") == "***":  # a secret's name
        return "librdkafka refuses its value (not shown: it is a secret)"
    return f"librdkafka refuses {clip(repr(redact(where, value)))}: {clip(redact_dsn(reason), 300)}"


def _frozen(settings: Mapping[str, Any]) -> tuple[tuple[str, str, Any], ...]:
    # the type too: 1, 1.0 and True are equal keys, and librdkafka reads "1", "1.0" and "true"
    return tuple((k, type(v).__name__, v) for k, v in settings.items() if k not in _UNCHECKED_KAFKA)


def _check_with_librdkafka(cfg: Config) -> None:
    """Every librdkafka setting of kafka.*, checked by librdkafka: a name it does not know or a
    value it refuses is a ConfigError naming the key, at load rather than when a client is made."""
    for section in ("client", "producer", "consumer"):
        written = getattr(cfg.kafka, section)
        for k, v in written.items():
            if isinstance(v, str) and "\0" in v:
                raise ConfigError(
                    f"kafka.{section}.{k}", "holds a NUL character (librdkafka would cut the value there)"
                )
        conf = {k: v for k, v in written.items() if k not in _UNCHECKED_KAFKA}
        if _refusal(conf) is None:
            continue
        for k, v in conf.items():
            reason = _refusal({k: v})
            if reason is not None:
                raise ConfigError(f"kafka.{section}.{k}", _kafka_problem(f"kafka.{section}.{k}", v, reason))
        raise ConfigError(f"kafka.{section}", "librdkafka refuses these settings together")
    h = cfg.harvester
    refused = _clients_refusal(
        _frozen(cfg.kafka.client),
        _frozen(cfg.kafka.producer),
        _frozen(cfg.kafka.consumer),
        silent_broker_wait_ms(h.heartbeat_timeout, h.session_timeout),
        h.transactional_id,
    )
    if refused is not None:
        part, reason = refused
        for section in ("client", "producer", "consumer"):  # a message may quote a value: secrets' are hidden
            for k, v in getattr(cfg.kafka, section).items():
                if redact(f"kafka.{section}.{k}", "x") == "***" and len(str(v)) >= 3:
                    reason = reason.replace(str(v), "***")
        for section in (part, "client"):
            for k in getattr(cfg.kafka, section):
                if re.search(f"[`\"']{re.escape(k)}[`\"']", reason):
                    raise ConfigError(f"kafka.{section}.{k}", f"librdkafka refuses it: {clip(redact_dsn(reason), 300)}")
        where = part if getattr(cfg.kafka, part) or not cfg.kafka.client else "client"
        raise ConfigError(
            f"kafka.{where}",
            f"librdkafka refuses the {part}'s settings (kafka.client, kafka.{part} over it, and what reaper sets): "
            f"{clip(redact_dsn(reason), 300)}",
        )


@functools.lru_cache(maxsize=32)
def _clients_refusal(
    client: tuple[tuple[str, str, Any], ...],
    producer: tuple[tuple[str, str, Any], ...],
    consumer: tuple[tuple[str, str, Any], ...],
    wait_ms: int,
    transactional_id: str,
) -> tuple[str, str] | None:
    """("producer" or "consumer", librdkafka's reason) when it refuses to make the data producer or a
    consumer out of these settings together (a setting that contradicts another, or one reaper sets),
    None when it makes both. The throwaway clients connect to nothing (_QUIET)."""
    common = {k: v for k, _, v in client}
    txn = {"transactional.id": transactional_id} if transactional_id else {}
    confs = {
        "producer": {
            **silent_broker_defaults(wait_ms, producer=True),
            **common,
            **{k: v for k, _, v in producer},
            **REQUIRED_PRODUCER,
            **txn,
            **_QUIET,
        },
        "consumer": {
            **silent_broker_defaults(wait_ms),
            **common,
            **{k: v for k, _, v in consumer},
            "group.id": "reaper-configuration-check",
            **_QUIET,
        },
    }
    for part, conf in confs.items():
        conf.pop("debug", None)
        try:
            made: Any = Producer(conf) if part == "producer" else Consumer(conf)
        except KafkaException as exc:
            reason = exc.args[0].str() if exc.args and hasattr(exc.args[0], "str") else str(exc)
            return part, " ".join(re.sub(r"^Failed to create \w+: ", "", reason).split())
        except Exception as exc:
            return part, f"{type(exc).__name__}: {exc}"
        if part == "consumer":
            made.close()
    return None
