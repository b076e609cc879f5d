"""A DSN libpq refuses before it uses the network (a bad option value such as `sslmode=bogus` or
`port=notaport`, an unknown option, a quote left open) is a configuration mistake: waiting or
retrying cannot help, so the commands report it as a ConfigError on `database.dsn` (exit 2).

`dsn_refusal` asks libpq itself, offline: the DSN as psycopg parses it, with every host replaced by
a Unix-socket directory that does not exist (and `hostaddr` checked here), is handed to
PQconnectStart. libpq checks every option's value before it connects, and a connection to a
missing socket fails at once without touching the network: a refusal that does not name that
socket is the options'. It is asked only once a connection has failed, so a DSN that works is never
judged by it.

libpq reads the TCP options (`keepalives`, `keepalives_idle`, `keepalives_interval`,
`keepalives_count`, `tcp_user_timeout`) only once it has a TCP socket, so the missing socket never
reaches them: when the DSN names a TCP host, they are checked here as libpq does, its integer rule
and then the same setsockopt calls on a socket that is never connected.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

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
    if _NOWHERE not in message:
        return _error(message, secrets, misread)
    tcp = _tcp_option_refusal(params, hosts, hostaddr)
    return None if tcp is None else _error(tcp, secrets, misread)


# libpq's TCP options, in the order it applies them, with the socket option each one sets
_KEEPALIVE_OPTIONS = (
    ("keepalives_idle", "TCP_KEEPIDLE"),
    ("keepalives_interval", "TCP_KEEPINTVL"),
    ("keepalives_count", "TCP_KEEPCNT"),
)
# strtol's leading white space, an optional sign, decimal digits; then only white space
_C_INT = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+[ \t\n\v\f\r]*\Z")


def _tcp_option_refusal(params: dict, hosts: list[str], hostaddr: str) -> str | None:
    """libpq's message for the TCP option it would refuse on reaching a TCP host of `hosts`, or
    None. A host is TCP unless it is a socket directory ("/...", "@...") or empty with no
    `hostaddr` (the default socket); PGHOST and PGHOSTADDR stand in for what the DSN leaves out."""
    if not any(hosts):
        hosts = os.environ.get("PGHOST", "").split(",")
    hostaddr = hostaddr or os.environ.get("PGHOSTADDR", "")
    if not hostaddr.strip(", ") and all(not h or h.startswith(("/", "@")) for h in hosts):
        return None  # every connection is over a Unix socket: libpq never reads these options
    keepalives = params.get("keepalives")
    if keepalives is not None:
        value, refused = _c_int(str(keepalives), "keepalives")
        if refused:
            return refused
        if value == 0:
            return None  # libpq reads neither the keepalive settings nor tcp_user_timeout then
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # never connected
        for option, name in (*_KEEPALIVE_OPTIONS, ("tcp_user_timeout", "TCP_USER_TIMEOUT")):
            raw = params.get(option)
            if raw is None or not hasattr(socket, name):
                continue
            value, refused = _c_int(str(raw), option)
            if refused:
                return refused
            try:
                probe.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), max(value, 0))  # libpq's clamp
            except OSError as exc:
                return f"setsockopt({name}) failed: {exc.strerror}"
    return None


def _c_int(value: str, option: str) -> tuple[int, str | None]:
    """`value` read as libpq reads an integer option: the number, or libpq's refusal."""
    if _C_INT.match(value) and -(2**31) <= int(value) < 2**31:
        return int(value), None
    return 0, f'invalid integer value "{value}" for connection option "{option}"'


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
