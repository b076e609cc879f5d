"""A DSN libpq refuses before it uses the network (a bad option value such as `sslmode=bogus` or
`port=notaport`, an unknown option, a quote left open) is a configuration mistake: waiting or
retrying cannot help, so the commands report it as a ConfigError on `database.dsn` (exit 2).

`dsn_refusal` asks libpq itself, offline: the DSN as psycopg parses it, with every host replaced by
a Unix-socket directory that does not exist (and `hostaddr` checked here), is handed to
PQconnectStart. libpq checks every option's value before it connects, and a connection to a
missing socket fails at once without touching the network: a refusal that does not name that
socket is the options'. It is asked only once a connection has failed, so a DSN that works is never
judged by it.
"""

from __future__ import annotations

import ipaddress
import re

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harvester.config_errors import ConfigError, clip
from harvester.redaction import redact_dsn

# options whose values are secrets: never shown, even when libpq refuses them
SECRET_OPTIONS = ("password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key")
# a directory no host has: libpq's connection to a socket in it fails at once, offline
_NOWHERE = "/nonexistent/reaper-dsn-check"
_URI = re.compile(r"\s*postgres(?:ql)?://([^/?#]*)(.*)", re.I | re.S)


def dsn_refusal(dsn: str) -> ConfigError | None:
    """The ConfigError on `database.dsn` for the option libpq refuses in `dsn`, or None when libpq
    accepts every option (a failure to connect is then the network's or the server's)."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:  # an unknown option, a quote left open, a bad URI (its text may quote a password)
        return _error(redact_dsn(str(exc)), {})
    secrets = {k: str(v) for k, v in params.items() if k in SECRET_OPTIONS and v not in (None, "")}
    misread = _password_misread(dsn)
    if misread:  # its host, port or user may be part of a password
        secrets.update({k: str(params[k]) for k in ("host", "port", "user") if params.get(k)})
    hostaddr = str(params.pop("hostaddr", "") or "")
    for addr in filter(None, (a.strip() for a in hostaddr.split(","))):
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            return _error(
                f'could not parse network address "{addr}" for connection option "hostaddr"', secrets, misread
            )
    hosts = str(params.get("host") or "").split(",")
    params["host"] = ",".join(_NOWHERE for _ in hosts)  # as many as written: libpq matches ports to hosts
    params["hostaddr"] = ""  # set, so libpq takes no PGHOSTADDR from the environment
    try:
        conninfo = make_conninfo("", **params)
    except psycopg.Error as exc:
        return _error(str(exc), secrets, misread)
    conn = pq.PGconn.connect_start(conninfo.encode())
    try:
        if conn.status != pq.ConnStatus.BAD:
            return None  # libpq took the options and is connecting: not expected for a missing socket
        message = conn.get_error_message()
    finally:
        conn.finish()
    return None if _NOWHERE in message else _error(message, secrets, misread)


def _password_misread(dsn: str) -> bool:
    """Whether `dsn` is a URI with an "@" after its host part: a password with an unescaped "/"
    (`postgresql://u:pa/ss@host/db`) is then read as a host and port, its first part as the port."""
    m = _URI.match(dsn)
    return m is not None and "@" not in m.group(1) and "@" in m.group(2)


def _error(message: str, secrets: dict[str, str], misread: bool = False) -> ConfigError:
    """libpq's reason, with the option it names and its value as written, secrets' values hidden."""
    text = " ".join(message.split())
    for value in sorted(secrets.values(), key=len, reverse=True):
        text = text.replace(f'"{value}"', '"***"')
        if len(value) >= 4:  # unquoted too, where it cannot be a word of libpq's own
            text = text.replace(value, "***")
    if misread:
        text += ' (not shown: with an "@" after the host, a password\'s unescaped "/" makes it the host and port; %-encode it)'
    return ConfigError("database.dsn", f"libpq refuses it: {clip(text, 400)}")
