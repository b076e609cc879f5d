"""The reaper's own Postgres connections carry TCP keepalives and a user timeout, so a server that
vanishes without a word fails them in seconds; a value the DSN sets itself wins."""

from __future__ import annotations

import asyncio
import socket

import psycopg
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harvester.db_liveness import LIVENESS, with_liveness
from harvester.db_pool import make_pool
from harvester.services.http.backend import _PoolStore

# libpq's names and the socket options they become on Linux
SOCKET_OPTIONS = {
    "keepalives_idle": (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
    "keepalives_interval": (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
    "keepalives_count": (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    "tcp_user_timeout": (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
}


def socket_settings(conn: psycopg.Connection | psycopg.AsyncConnection) -> dict[str, int]:
    sock = socket.socket(fileno=conn.pgconn.socket)
    try:
        out = {name: sock.getsockopt(level, opt) for name, (level, opt) in SOCKET_OPTIONS.items()}
        out["keepalives"] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        return out
    finally:
        sock.detach()  # the descriptor is libpq's


@settings(max_examples=200, deadline=None)
@given(
    own=st.dictionaries(st.sampled_from(sorted(LIVENESS)), st.integers(0, 100_000), max_size=len(LIVENESS)),
    password=st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12),
    uri=st.booleans(),
)
def test_the_dsn_keeps_its_own_values_and_gets_the_rest(own, password, uri):
    base = {
        "host": "db-a.example,db-b.example",
        "port": "5432,5433",
        "dbname": "outbox",
        "user": "reaper",
        "password": password,
        "target_session_attrs": "read-write",
    }
    if uri:
        from urllib.parse import quote

        query = "&".join(f"{k}={v}" for k, v in own.items())
        dsn = f"postgresql://reaper:{quote(password, safe='')}@db-a.example:5432,db-b.example:5433/outbox"
        dsn += "?target_session_attrs=read-write" + (f"&{query}" if query else "")
    else:
        dsn = make_conninfo("", **base, **own)
    got = conninfo_to_dict(with_liveness(dsn))
    for key, value in LIVENESS.items():
        assert got[key] == str(own.get(key, value)), (key, dsn)
    assert got.get("password", "") == password
    assert got["target_session_attrs"] == "read-write"
    assert got["dbname"] == "outbox"
    assert {got["host"], got["port"]} == {"db-a.example,db-b.example", "5432,5433"}


def test_a_malformed_dsn_is_left_for_libpq_to_name():
    assert with_liveness("host='unterminated") == "host='unterminated"


def test_the_harvester_pool_sockets_carry_them(pg_dsn):
    pool = make_pool(pg_dsn, 1, name="liveness-test")
    try:
        with pool.connection() as conn:
            assert socket_settings(conn) == LIVENESS
    finally:
        pool.close()
    own = make_conninfo(pg_dsn, keepalives_idle=7, tcp_user_timeout=4321)
    pool = make_pool(own, 1, name="liveness-test-own")
    try:
        with pool.connection() as conn:
            assert socket_settings(conn) == LIVENESS | {"keepalives_idle": 7, "tcp_user_timeout": 4321}
    finally:
        pool.close()


def test_the_http_service_pool_sockets_carry_them(pg_dsn, schema):
    async def main() -> dict[str, int]:
        store = _PoolStore(pg_dsn, schema, completion_topic="t", pool_size=1, timeout=10)
        await store.open()
        try:
            async with store.pool.connection() as conn:
                return socket_settings(conn)
        finally:
            await store.close()

    assert asyncio.run(main()) == LIVENESS


def test_a_service_files_own_values_win(pg_dsn, tmp_path, monkeypatch):
    """A DSN that names a service gets the service's settings from libpq, after the DSN's own: a
    keepalive setting in the service file is the user's value, and it wins as one in the DSN does."""
    given = conninfo_to_dict(pg_dsn)
    section = {k: v for k, v in given.items() if k in ("host", "port", "dbname", "user", "password")}
    section |= {"keepalives_idle": "7", "tcp_user_timeout": "4321"}
    services = tmp_path / "pg_service.conf"
    services.write_text(
        "# a comment\n[other]\nkeepalives_idle=9\n\n[outbox]\n"
        + "\n".join(f"{k}={v}" for k, v in section.items())
        + "\n"
    )
    monkeypatch.setenv("PGSERVICEFILE", str(services))
    monkeypatch.delenv("PGSERVICE", raising=False)
    own = LIVENESS | {"keepalives_idle": 7, "tcp_user_timeout": 4321}
    for dsn, env in (("service=outbox", None), ("", "outbox"), ("postgresql://?service=outbox", None)):
        if env is not None:
            monkeypatch.setenv("PGSERVICE", env)
        with psycopg.connect(with_liveness(dsn)) as conn:
            assert socket_settings(conn) == own, (dsn, with_liveness(dsn))
        monkeypatch.delenv("PGSERVICE", raising=False)
    # A service defined where only libpq looks (its built-in directory) may set them: nothing is added.
    monkeypatch.setenv("PGSYSCONFDIR", str(tmp_path / "none"))
    assert with_liveness("service=elsewhere dbname=x") == "service=elsewhere dbname=x"


def test_a_connect_timeout_is_added_unless_the_dsn_or_the_environment_sets_one(monkeypatch):
    from psycopg.conninfo import conninfo_to_dict

    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    assert conninfo_to_dict(with_liveness("host=h"))["connect_timeout"] == "10"
    assert conninfo_to_dict(with_liveness("host=h connect_timeout=3"))["connect_timeout"] == "3"
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "45")
    assert "connect_timeout" not in conninfo_to_dict(with_liveness("host=h"))  # libpq reads the variable


def test_the_pools_connect_timeout_yields_to_the_dsn_and_the_environment(pg_dsn, monkeypatch):
    from harvester.db_pool import CONNECT_TIMEOUT, make_pool

    def effective(dsn: str) -> str | None:
        pool = make_pool(dsn, 1, open_wait=10)
        try:
            with pool.connection() as conn:
                return next((o.val.decode() for o in conn.pgconn.info if o.keyword == b"connect_timeout"), None)
        finally:
            pool.close()

    monkeypatch.delenv("PGCONNECT_TIMEOUT", raising=False)
    assert effective(pg_dsn) == str(CONNECT_TIMEOUT)
    assert effective(pg_dsn + ("&" if "?" in pg_dsn else "?") + "connect_timeout=45") == "45"
    monkeypatch.setenv("PGCONNECT_TIMEOUT", "44")
    assert effective(pg_dsn) == "44"
