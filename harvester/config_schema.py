"""The vocabulary of the `reaper` configuration schema, and what it derives for each key.

A key is a dataclass field whose type and default are the field's and whose `Rule` (description,
bounds, allowed values, secrecy) is `key(...)`'s metadata. `Setting` is one key as everything
derived from the schema sees it: how a value as written (YAML scalar, environment text) becomes
the key's type, its check, its environment variable, its redaction and its line in the
configuration reference. The keys themselves are in harvester.config_keys.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harvester.config_errors import ConfigError, clip
from harvester.config_yaml import load_yaml
from harvester.redaction import redact, redact_dsn
from tracker import is_topic_name
from tracker.errors import InvalidIdentifier
from tracker.schema import check_identifier

ENV_PREFIX = "REAPER_"


@dataclass(frozen=True)
class Check:
    """A rule for a text key: it must fully match `regex` (or be a plain SQL identifier, when
    `identifier` names what it is); `optional`: the empty string is allowed too (= off)."""

    allowed: str  # how the configuration reference describes the rule
    regex: str = ""
    refusal: str = ""  # the message when it does not match; {value!r} is the value
    identifier: str = ""
    optional: bool = False
    accepts: Callable[[str], bool] | None = None  # instead of `regex`: a rule stated elsewhere

    def problem(self, value: str) -> str | None:
        if self.optional and value == "":
            return None
        if self.identifier:
            try:
                check_identifier(value, self.identifier)
            except InvalidIdentifier as exc:
                return clip(str(exc))
            return None
        if not (self.accepts(value) if self.accepts is not None else re.fullmatch(self.regex, value)):
            return self.refusal.format(value=clip(value, 120))
        return None


# Kafka's rule, as the tracker states it for every call: 1 to 249 of [A-Za-z0-9._-], not '.' or '..'.
TOPIC = Check("Kafka topic name", accepts=is_topic_name, refusal="{value!r} is not a valid Kafka topic name")


@dataclass(frozen=True)
class Rule:
    """What a key's field does not say itself: its description, bounds, allowed values, secrecy."""

    doc: str
    gt: float | None = None  # numbers: value > gt
    ge: float | None = None  # value >= ge
    le: float | None = None  # value <= le
    note: str = ""  # what a boundary value means, e.g. "0 = off"
    choices: tuple[str, ...] = ()  # text: one of these
    ignore_case: bool = False  # ... in any case
    check: Check | None = None  # text: a pattern or identifier
    secret: bool = False  # hidden in logs, error messages and `redacted()` (passwords in DSNs always are)


def key(default: Any, doc: str, **rule: Any) -> Any:
    """A configuration key: a dataclass field with its default and its Rule."""
    meta = {"rule": Rule(doc, **rule)}
    if isinstance(default, (dict, list)):
        return field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One key of the schema, as everything derived from it sees it."""

    section: str
    name: str
    kind: type  # bool, int, float, str, dict (librdkafka pass-through) or list
    default: Any
    rule: Rule

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        """Its environment variable; a mapping takes one per entry: `<env>__<NAME>`."""
        return f"{ENV_PREFIX}{self.section.upper()}__{self.name.upper()}"

    @property
    def is_mapping(self) -> bool:
        return self.kind is dict

    @property
    def bounds(self) -> str:
        r = self.rule
        if r.ge is not None and r.le is not None:
            return f"from {_num(r.ge)} to {_num(r.le)}"
        parts = [f"{op} {_num(v)}" for op, v in ((">", r.gt), (">=", r.ge), ("<=", r.le)) if v is not None]
        return " and ".join(parts)

    @property
    def kind_word(self) -> str:
        return _KIND_WORDS[self.kind]

    @property
    def allowed(self) -> str:
        """The rule in words, for the configuration reference."""
        r = self.rule
        words = [
            _KIND_WORDS[self.kind] + (f" {self.bounds}" if self.bounds else "") + (f" ({r.note})" if r.note else "")
        ]
        if r.choices:
            words.append(", ".join(r.choices))
        if r.check is not None:
            words.append(r.check.allowed)
        if r.secret:
            words.append("secret: hidden in logs")
        return "; ".join(words)

    def shown(self, value: Any) -> str:
        """The value for an error message: as written, unless it is secret; clipped when it is long."""
        return clip(repr(self.redact(value)))

    def redact(self, value: Any) -> Any:
        if self.rule.secret:
            return value if value is None or value == "" else "***"
        if isinstance(value, str):
            return redact_dsn(value)
        if isinstance(value, (Mapping, list, tuple, set, frozenset)):
            return redact(self.dotted, value)  # by the names of their entries
        return value  # a number of a key that is not secret (its name may still look it: max_waits_per_token)

    def coerce(self, value: Any) -> Any:
        """The value as written (YAML scalar, environment text, Python value) as this key's type."""
        kind = self.kind
        if kind is bool:
            if isinstance(value, bool):
                return value
            # str() of an integer of thousands of digits raises: only 0 and 1 are read
            text = value.strip().lower() if isinstance(value, str) else ""
            if isinstance(value, int):
                text = {0: "0", 1: "1"}.get(value, "")
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
        elif kind is int and not isinstance(value, bool):
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):  # from the environment: "2" is 2, "2.7" is refused
                try:
                    return int(value)
                except ValueError:  # not an integer, or more digits than Python converts
                    pass
        elif kind is float and not isinstance(value, bool):
            if isinstance(value, (int, float)):
                try:
                    return float(value)
                except OverflowError:  # an integer past a double's range
                    raise ConfigError(self.dotted, f"must be a finite number, got {self.shown(value)}") from None
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        elif kind is str:
            if isinstance(value, (str, int, float)) and not isinstance(value, bool):
                try:
                    return str(value)
                except ValueError:  # an integer of more digits than Python converts
                    pass
        elif kind is dict:
            if isinstance(value, Mapping):
                return {str(k): v for k, v in value.items()}
        elif kind is list:
            if isinstance(value, str):  # from the environment: a YAML (or JSON) list
                value = load_yaml(value, self.dotted)
            if isinstance(value, list):
                return list(value)
        # the message is made only now: the value may be large (it is clipped, and redacted first)
        raise ConfigError(self.dotted, f"expected {kind.__name__}, got {self.shown(value)}")

    def check(self, value: Any, written: Any = None) -> None:
        """Raise ConfigError when `value` (coerced) breaks this key's rule; name it as `written`."""
        r = self.rule

        def shown() -> str:
            return self.shown(value if written is None else written)

        if self.kind is float and not math.isfinite(value):
            raise ConfigError(self.dotted, f"must be a finite number, got {shown()}")
        if self.kind in (int, float) and (
            (r.gt is not None and not value > r.gt)
            or (r.ge is not None and not value >= r.ge)
            or (r.le is not None and not value <= r.le)
        ):
            note = f" ({r.note})" if r.note else ""
            raise ConfigError(self.dotted, f"must be {self.bounds}{note}, got {shown()}")
        if r.choices and (value.lower() if r.ignore_case else value) not in r.choices:
            *head, last = r.choices
            raise ConfigError(self.dotted, f"{shown()}: use {', '.join(head)} or {last}")
        if r.check is not None:
            problem = r.check.problem(value)
            if problem is not None:
                raise ConfigError(self.dotted, problem)


_KIND_WORDS = {bool: "true or false", int: "integer", float: "number", str: "text", dict: "mapping", list: "list"}


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
