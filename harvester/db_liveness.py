"""TCP liveness for the reaper's own long-lived Postgres connections.

A server that vanishes without a word (a host powered off, a failover that moves the address, a
firewall that drops packets) leaves a connection waiting for an answer that never comes: Linux gives
up on unacknowledged data after about 15 minutes, and on an idle connection never. With keepalives
and a TCP user timeout, libpq's socket fails within seconds instead, and the reaper's usual recovery
takes over (a new connection, through a multi-host DSN to the new primary). A value the DSN sets
itself wins; over a Unix socket libpq ignores them.
"""

from __future__ import annotations

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


def with_liveness(dsn: str) -> str:
    """`dsn` with the liveness settings it does not set itself."""
    try:
        given = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return dsn  # a malformed DSN fails at connect, with libpq's own message
    return make_conninfo(dsn, **{k: v for k, v in LIVENESS.items() if k not in given})
