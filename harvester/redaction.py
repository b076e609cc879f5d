"""Secrets hidden wherever configuration values are shown: values of secret-looking keys (librdkafka
settings, outbox entries) whatever their type, and passwords inside DSNs in every form libpq reads."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harvester.config_yaml import MAX_YAML_DEPTH

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
# ... but the option an integer value was refused for is named: only the value may be a password's part
_LIBPQ_INTEGER = re.compile(r"""(invalid integer value\s*)"[^\n]*"(\s*for connection option "[A-Za-z_]+")""", re.I)
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
    text = _KV_PASSWORD.sub(r"\1***", text)
    parts = _LIBPQ_INTEGER.split(text)  # [text, head, option, text, ...]: the option's name kept
    for i in range(0, len(parts), 3):
        parts[i] = _LIBPQ_QUOTE.sub(r'\1"***"', parts[i])
    for i in range(1, len(parts), 3):
        parts[i] = f'{parts[i]}"***"'
    return "".join(parts)


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
