"""harvester.outboxes read: the harvest units of a configuration, and the ack topic of each schema.

Both are checked here as they are derived, so a bad entry fails at start with a ConfigError naming
its key; harvester.config's checks call them, and importers take them from there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from harvester.config_errors import ConfigError, clip
from harvester.config_keys import MAX_LANES, Config, OutboxEntry
from harvester.config_schema import TOPIC
from harvester.redaction import redact
from tracker.errors import InvalidIdentifier
from tracker.schema import check_identifier

MAX_UNITS = 256

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
    check_dsn("database.dsn", db.dsn)  # the ackers' and the sweeper's, whatever the outboxes say
    # Within 63 bytes, as their keys' own check has it, and also leaving room for the names derived
    # from them (the schema's roles, the outbox table's dead-row table): whatever the outboxes say.
    _check_name("database.schema", db.schema, "schema")
    _check_name("database.outbox_table", db.outbox_table, "outbox table")
    out: list[UnitSpec] = []
    seen: set[str] = set()
    tables: dict[tuple[tuple[object, ...], str, str], int] = {}  # (database, schema, table) -> entry
    for i, entry in enumerate(entries):
        key = f"harvester.outboxes[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(
                key, f"expected a mapping with keys {sorted(_OUTBOX_KEYS)}, got {clip(repr(redact(key, entry)))}"
            )
        unknown = set(entry) - _OUTBOX_KEYS
        if unknown:
            first = clip(sorted(map(str, unknown))[0], 80)  # (YAML keys need not be text)
            raise ConfigError(f"{key}.{first}", f"unknown key (known: {', '.join(sorted(_OUTBOX_KEYS))})")
        name = entry.get("name", f"outbox{i}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name):
            raise ConfigError(f"{key}.name", f"{clip(repr(name))} must be 1-40 of A-Z a-z 0-9 _ -")
        if name in seen:
            raise ConfigError(f"{key}.name", f"{name!r} is listed twice")
        seen.add(name)
        schema, table = entry.get("schema", db.schema), entry.get("table", db.outbox_table)
        _check_name(f"{key}.schema", schema, "schema")
        _check_name(f"{key}.table", table, "outbox table")
        dsn = entry.get("dsn", db.dsn)
        check_dsn(f"{key}.dsn" if "dsn" in entry else "database.dsn", dsn)
        # One table, one entry: a second unit of it could never claim it (the first holds the
        # table's harvest claim) and would say another configuration harvests it.
        listed = tables.setdefault((_database(dsn), schema, table), i)
        if listed != i:
            raise ConfigError(
                key,
                f"names table {schema}.{table} of harvester.outboxes[{listed}] again (the same database): "
                "list each table once, and split a busy one with lanes",
            )
        lanes = entry.get("lanes", 1)
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
            lanes_key = "harvester.lanes" if not h.outboxes else f"{key}.lanes"
            raise ConfigError(lanes_key, f"{lanes!r} must be an integer from 1 to {MAX_LANES}")
        if len(out) + lanes > MAX_UNITS:  # checked as they are made: the list may be long
            raise ConfigError("harvester.outboxes", f"more than {MAX_UNITS} units (harvest units: lanes of outboxes)")
        for lane in range(lanes):
            out.append(UnitSpec(len(out), name, dsn, schema, table, lane, lanes))
    return out


def _database(dsn: str) -> tuple[object, ...]:
    """Which database a DSN (read by check_dsn) connects to, whatever its form, user or options."""
    info = conninfo_to_dict(dsn)
    return tuple(info.get(k) for k in ("host", "hostaddr", "port", "service")) + (
        info.get("dbname") or info.get("user"),
    )


def _check_name(key: str, value: Any, what: str) -> None:
    try:
        check_identifier(value, what)
    except InvalidIdentifier as exc:
        raise ConfigError(key, clip(str(exc), 400)) from None  # a name of 63 bytes and why, whole


# libpq's messages about a DSN it cannot read quote the text where it stopped, which may be part of
# the password: the reason is told in these words instead
_DSN_PROBLEMS = (
    ("%00", "a %00 escape (NUL is not allowed)"),
    ("percent-encoded", "a %-escape that is not % and two hexadecimal digits (write % itself as %25)"),
    ('missing "="', "a word without \"=\" (quote a value with spaces in it: password='a b')"),
    ("unterminated quoted string", "a quoted value that is not closed"),
    ("invalid connection option", "an unknown connection option"),
    ("URI query parameter", "a malformed URI query parameter"),
    ("IPv6 host", "a malformed [IPv6] host"),
    ("unexpected character", "an unexpected character in the URI"),
    ("unexpected spaces", "a space in the URI (write it as %20)"),
)


def check_dsn(key: str, dsn: Any) -> None:
    """A ConfigError naming `key` unless libpq can read `dsn` (it is not echoed: libpq's message
    quotes the DSN's text, which may be its password)."""
    if not isinstance(dsn, str) or not dsn:
        raise ConfigError(key, "must be a non-empty libpq URI or key=value string")
    try:
        conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        text = str(exc)
        why = next((said for found, said in _DSN_PROBLEMS if found in text), "libpq cannot read it")
        raise ConfigError(key, f"not a libpq URI or key=value string: {why}") from None


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


def reserved_topics(cfg: Config) -> frozenset[str]:
    """The topics the reaper reads, which no outbox row may name: the leader topic, every ack topic
    and the acks' dead-letter topic, whether this process's acker runs or not (another process's
    acker, or a Spark ack stream, applies them): a row published there with the reaper's
    credentials could ack or fail any batch's items."""
    return frozenset({cfg.harvester.leader_topic, *ack_topics(cfg).values(), cfg.acker.dead_letter_topic})
