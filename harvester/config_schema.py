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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import yaml
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tracker.errors import InvalidIdentifier
from tracker.schema import check_identifier

ENV_PREFIX = "REAPER_"


class ConfigError(ValueError):
    def __init__(self, key: str, message: str) -> None:
        self.key, self.problem = key, message
        super().__init__(f"configuration key {key!r}: {message}")


@dataclass(frozen=True)
class Check:
    """A rule for a text key: it must fully match `regex` (or be a plain SQL identifier, when
    `identifier` names what it is); `optional`: the empty string is allowed too (= off)."""

    allowed: str  # how the configuration reference describes the rule
    regex: str = ""
    refusal: str = ""  # the message when it does not match; {value!r} is the value
    identifier: str = ""
    optional: bool = False

    def problem(self, value: str) -> str | None:
        if self.optional and value == "":
            return None
        if self.identifier:
            try:
                check_identifier(value, self.identifier)
            except InvalidIdentifier as exc:
                return clip(str(exc))
            return None
        if not re.fullmatch(self.regex, value):
            return self.refusal.format(value=clip(value, 120))
        return None


# Kafka's rule (as tracker.core.validate.check_topic): 1 to 249 of these characters, not '.' or '..'.
TOPIC = Check("Kafka topic name", r"(?!\.{1,2}$)[A-Za-z0-9._-]{1,249}", "{value!r} is not a valid Kafka topic name")


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


def clip(text: str, limit: int = 200) -> str:
    """`text`, cut to `limit` characters: an error message names a value, it does not reprint it."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


# ------------------------------------------------------------------ YAML

MAX_YAML_DEPTH = 20  # nesting of mappings and lists; the configuration itself needs 5


class _ConfigLoader(yaml.SafeLoader):
    """YAML as the configuration reads it: the safe loader, stricter. Aliases (`*name`) are refused:
    a few hundred bytes of them expand to billions of nodes, or to a value that contains itself.
    A key written twice in one mapping is refused (YAML would keep the last silently, dropping a whole
    section). Nesting is bounded, and a scalar Python cannot construct (an integer of more digits than
    it converts, a date that does not exist) is a YAML error with its place, not an exception."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                f"found an alias (*{clip(str(event.anchor), 40)}): aliases are not allowed in the configuration; "
                "write the value out",
                event.start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError):  # the scalar's text is not repeated: it may be a secret
            what = {
                "tag:yaml.org,2002:int": "an integer with too many digits",
                "tag:yaml.org,2002:timestamp": "not a valid date or time (quote it to write text)",
            }.get(node.tag, f"a {node.tag.rpartition(':')[2]} value that cannot be read")
            raise yaml.constructor.ConstructorError(None, None, what, node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                name = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(name, key_node.start_mark)
                except TypeError:  # an unhashable key: the safe loader refuses it
                    break
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"found key {clip(repr(name), 80)} twice in one mapping (first at line {first.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep)


def load_yaml(text: str, where: str) -> Any:
    """`text` read as YAML by the configuration's rules; a ConfigError naming `where` and the place
    (never the line: it may hold a password) when it cannot be."""
    loader = None
    try:
        loader = _ConfigLoader(text)  # (it checks the characters at once)
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(where, f"not valid YAML: {yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(where, f"not valid YAML: nested more than {MAX_YAML_DEPTH} levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the offending line: it may hold a password."""
    if isinstance(exc, yaml.reader.ReaderError):
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"character #x{code:04x} is not allowed in YAML (at character {exc.position + 1})"
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


# ------------------------------------------------------------------ secrets

# key names whose values are secrets (librdkafka's and outbox entries'); passwords in DSNs are found apart
_SECRET = re.compile(
    r"password|passphrase|secret|token|credential|sasl\.jaas|ssl\.key|private\.key|oauthbearer\.config", re.I
)
_REDACT_NODES = 10_000  # values a redacted structure shows at most; the rest is "..."
_REDACT_DEPTH = MAX_YAML_DEPTH


def redact(key: str, value: Any) -> Any:
    """Hide secrets in free-form values (librdkafka settings, outbox entries): values of
    secret-looking keys, whatever their type, and passwords inside DSNs. Safe on any structure:
    a value that contains itself, or a very large one, is shown in part."""
    return _redact(key, value, [_REDACT_NODES], frozenset(), 0)


def _redact(key: str, value: Any, budget: list[int], path: frozenset[int], depth: int) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > _REDACT_DEPTH:
        return "..."
    if _SECRET.search(key):
        return value if value is None or (isinstance(value, str) and value == "") else "***"
    if isinstance(value, str):
        return redact_dsn(value)
    if not isinstance(value, (Mapping, list, tuple, set, frozenset)):
        return value
    if id(value) in path:
        return "<recursive>"
    inner = path | {id(value)}
    if isinstance(value, Mapping):
        out: dict[Any, Any] = {}
        for k, v in value.items():
            if budget[0] <= 0:
                out["..."] = "..."
                break
            out[k] = _redact(f"{key}.{k}", v, budget, inner, depth + 1)
        return out
    items: list[Any] = []
    for i, v in enumerate(value):
        if budget[0] <= 0:
            items.append("...")
            break
        items.append(_redact(f"{key}[{i}]", v, budget, inner, depth + 1))
    return items


# Both libpq forms, as libpq reads them (fe-connect.c): a URI is `postgres[ql]://[user[:password]@]
# hosts[/dbname][?key=value&...]`, its parts %-encoded, `password` and `sslpassword` also allowed as
# query parameters (their names %-encoded too); a key=value string is `key = value` pairs, a value
# either 'quoted' (\' and \\ escaped) or unquoted up to white space (a backslash escapes the next
# character, a space too). A DSN's `dbname` may itself be a DSN.
_URI = re.compile(r"postgres(?:ql)?://", re.I)
# (libpq's white space is ASCII's: a no-break space is part of a value)
_URI_END = re.compile(r"""[\s"'<>`]""", re.ASCII)  # where a URI quoted inside a message ends
_KV_PASSWORD = re.compile(r"""(password\s*=\s*)('(?:\\[\s\S]|[^'\\])*'?|(?:\\[\s\S]?|[^\s\\])*)""", re.I | re.ASCII)
# libpq's messages about a DSN it cannot read quote the text it stopped at: a password, or part of one
_LIBPQ_QUOTE = re.compile(
    r"""((?:percent-encoded (?:token|value)|missing "=" after|invalid connection option|invalid integer value"""
    r"""|URI query parameter|in URI(?: \(expected ":" or "/"\))?|unexpected spaces found in):?\s*)"[^\n]*\"""",
    re.I,
)
_SECRET_PARAMS = ("password", "sslpassword")


def redact_dsn(text: str) -> str:
    """`text` (a DSN, or a message that may quote one) with every password hidden."""
    if _URI.match(text.lstrip()):  # a DSN that is a URI: all of it, spaces and quotes included
        start = len(text) - len(text.lstrip())
        shown = text[:start] + _redact_uri(text[start:])
    else:
        parts, at = [], 0
        for m in _URI.finditer(text):
            if m.start() < at:
                continue
            end = _URI_END.search(text, m.end())
            stop = end.start() if end else len(text)
            parts += [_redact_text(text[at : m.start()]), _redact_uri(text[m.start() : stop])]
            at = stop
        shown = "".join([*parts, _redact_text(text[at:])])
    return shown if not _still_shows_a_password(text, shown) else _without_secrets(text)


def _redact_text(text: str) -> str:
    return _LIBPQ_QUOTE.sub(r'\1"***"', _KV_PASSWORD.sub(r"\1***", text))


def _redact_uri(uri: str) -> str:
    """libpq takes what comes before the first "@" (and no "/") as user[:password]; the password
    hidden here runs to the last "@": an unescaped "@", "/", "?" or space in it stays hidden too."""
    head = _URI.match(uri)
    assert head is not None
    rest = uri[head.end() :]
    at = rest.rfind("@")
    userinfo, hosts = (rest[:at], rest[at:]) if at >= 0 else ("", rest)
    user, colon, _ = userinfo.partition(":")
    if colon:
        userinfo = f"{user}:***"
    path, question, query = hosts.partition("?")
    if question:
        params = []
        for param in query.split("&"):
            name, equals, _ = param.partition("=")
            secret = any(p in unquote(name).lower() for p in _SECRET_PARAMS)
            params.append(f"{name}=***" if secret and equals else param)
        hosts = f"{path}?{'&'.join(params)}"
    return f"{head.group()}{userinfo}{hosts}"


def _parsed(text: str) -> dict[str, Any] | None:
    if "=" not in text and "://" not in text:
        return None
    try:
        return conninfo_to_dict(text)
    except Exception:  # not a DSN (a message, a name): only the patterns above apply
        return None


def _still_shows_a_password(text: str, shown: str) -> bool:
    """Whether libpq would still read a password out of `shown`, or `shown` still holds the one
    libpq reads out of `text`: what the patterns above missed."""
    before = _parsed(text)
    if before is None:
        return False
    secrets = [str(before[k]) for k in _SECRET_PARAMS if before.get(k)]
    if not secrets:
        return False
    if any(len(s) >= 4 and s in shown for s in secrets):
        return True
    after = _parsed(shown)
    return after is None or any(after.get(k) not in (None, "", "***") for k in _SECRET_PARAMS)


def _without_secrets(text: str) -> str:
    """The DSN `text` written again, in key=value form, with its passwords hidden."""
    params = _parsed(text) or {}
    secrets = [str(params[k]) for k in _SECRET_PARAMS if params.get(k)]
    try:
        shown = make_conninfo(**{k: ("***" if k in _SECRET_PARAMS and v else v) for k, v in params.items()})
    except Exception:
        return "***"
    return "***" if any(s in shown for s in secrets) else shown
