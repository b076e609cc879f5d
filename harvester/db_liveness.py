"""TCP liveness for the reaper's own long-lived Postgres connections.

A server that vanishes without a word (a host powered off, a failover that moves the address, a
firewall that drops packets) leaves a connection waiting for an answer that never comes: Linux gives
up on unacknowledged data after about 15 minutes, and on an idle connection never. With keepalives
and a TCP user timeout, libpq's socket fails within seconds instead, and the reaper's usual recovery
takes over (a new connection, through a multi-host DSN to the new primary). A value the DSN sets
itself wins, and so does one in the connection service it names (`service=` or PGSERVICE), which
libpq reads after the DSN: a setting added to the DSN would hide it. Over a Unix socket libpq
ignores them.
"""

from __future__ import annotations

import os
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

# An idle connection is probed after 5 s and dropped after 3 unanswered probes 2 s apart; data sent
# and not acknowledged for 10 s drops it too. A reachable server's kernel acknowledges at once,
# however busy Postgres is, so a healthy connection never meets these bounds.
LIVENESS: dict[str, int] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


def _service_keys(path: Path, service: str) -> set[str] | None:
    """The keywords `service`'s section of the service file at `path` sets, None when the file or the
    section is not there (libpq's format: `[name]` sections of `keyword=value` lines, `#` comments)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    keys: set[str] | None = None
    current = None
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line[1:].split("]", 1)[0]
            if current == service and keys is None:
                keys = set()
            continue
        if current == service and keys is not None and "=" in line:
            keys.add(line.split("=", 1)[0].strip())
    return keys


def _from_service(service: str) -> set[str] | None:
    """What the service sets, from the files libpq reads in its order (the user's, then the one in
    PGSYSCONFDIR); None when its definition is in none of them (libpq's built-in directory, which
    only libpq knows)."""
    # expanduser, not Path.home(): no home directory (a container user without one) is no user file
    user = os.environ.get("PGSERVICEFILE") or os.path.expanduser("~/.pg_service.conf")
    files = [Path(user)]
    if sysconf := os.environ.get("PGSYSCONFDIR"):
        files.append(Path(sysconf) / "pg_service.conf")
    for path in files:
        if (keys := _service_keys(path, service)) is not None:
            return keys
    return None


# libpq waits for ever for a server that accepts the connection and never answers (a hung host, a
# stuck proxy): a thread connecting to it could not notice a stop. Each host attempt is bounded.
CONNECT_TIMEOUT = 10


def with_liveness(dsn: str, connect_timeout: int = CONNECT_TIMEOUT) -> str:
    """`dsn` with the liveness settings (LIVENESS, and a `connect_timeout` of `connect_timeout`
    seconds) neither it, nor the service it names, nor (for the timeout) PGCONNECT_TIMEOUT sets."""
    try:
        parsed = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return dsn  # a malformed DSN fails at connect, with libpq's own message
    given = set(parsed)
    if service := parsed.get("service") or os.environ.get("PGSERVICE"):
        from_service = _from_service(str(service))
        if from_service is None:
            return dsn  # a service we cannot read may set them: libpq applies it as the user wrote it
        given |= from_service
    wanted: dict[str, int] = dict(LIVENESS)
    if os.environ.get("PGCONNECT_TIMEOUT", "").strip() == "":  # the environment's wins, as libpq reads it
        wanted["connect_timeout"] = connect_timeout
    return make_conninfo(dsn, **{k: v for k, v in wanted.items() if k not in given})
