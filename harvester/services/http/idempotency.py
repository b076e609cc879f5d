"""Idempotency-Key on POST (the IETF httpapi draft's semantics), exactly once through Postgres.

A POST with `Idempotency-Key: "<key>"` runs in one database transaction together with the record
of its answer (table http_idempotency, migration 0013), keyed by (token, key):

- the first request claims the key, does its work and stores its answer; both commit together,
  so a crash in between leaves neither, and a retry simply does the work;
- a retry with the same key and the same request (method, path and body) gets the stored answer
  back (`Idempotent-Replayed: true`) and changes nothing; one that arrives while the first is
  still running waits for it on the key's row, then gets its answer;
- the same key with another request is refused (422), as is a malformed key (400);
- a request whose work fails (an error problem) stores nothing: its retry runs again;
- keys expire after `http.idempotency_window` seconds; the server deletes expired ones in chunks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import psycopg
import structlog
from psycopg import sql

from harvester.services.http.backend import Store, StoreUnavailable
from harvester.services.http.problems import Problem
from harvester.services.http.security import Scope, headers_of

# An sf-string (RFC 8941) of 1 to 255 printable ASCII characters, no escapes needed inside.
_KEY = re.compile(r'"([\x20\x21\x23-\x5b\x5d-\x7e]{1,255})"')


@dataclass
class Reply:
    """What a POST answers: stored as it is, replayed as it was."""

    status: int
    doc: dict[str, object]
    headers: dict[str, str] = field(default_factory=dict)
    completed: list[int] = field(default_factory=list)  # batches to wake long-polls for (not replayed)


def key_of(scope: Scope) -> str | None:
    """The request's Idempotency-Key, or None; a malformed or repeated header is a 400."""
    values = [v for n, v in headers_of(scope) if n == b"idempotency-key"]
    if not values:
        return None
    if len(values) > 1:
        raise Problem(
            "invalid-request", "the request has more than one Idempotency-Key header", field="Idempotency-Key"
        )
    m = _KEY.fullmatch(values[0].decode("latin-1").strip())
    if m is None:
        raise Problem(
            "invalid-request",
            'Idempotency-Key must be a quoted string of 1 to 255 printable ASCII characters, e.g. "8e03978e-40d5"',
            field="Idempotency-Key",
        )
    return m.group(1)


def fingerprint(method: str, path: str, body: bytes) -> bytes:
    return hashlib.sha256(b"\0".join([method.encode(), path.encode("utf-8", "surrogateescape"), body])).digest()


def _statements(schema: str) -> dict[str, str]:
    t = sql.Identifier(schema, "http_idempotency")
    q = {
        # Claims a free (or expired) key; on a live key's row it waits for its transaction, then returns nothing.
        "claim": "INSERT INTO {t} (token, key, fingerprint, reply, expires_at)"
        " VALUES (%s, %s, %s, 'null', now() + make_interval(secs => %s))"
        " ON CONFLICT (token, key) DO UPDATE SET fingerprint = EXCLUDED.fingerprint, reply = 'null',"
        " created_at = now(), expires_at = EXCLUDED.expires_at WHERE {t}.expires_at <= now()"
        " RETURNING 1",
        "stored": "SELECT fingerprint, reply FROM {t} WHERE token = %s AND key = %s",
        "store": "UPDATE {t} SET reply = %s WHERE token = %s AND key = %s",
        "expire": "DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT %s))",
    }
    return {k: sql.SQL(v).format(t=t).as_string(None) for k, v in q.items()}


class Idempotency:
    def __init__(self, store: Store, window: float) -> None:
        self.store, self.window = store, window
        self.q = _statements(store.schema)
        self._log = structlog.get_logger("reaper.http")

    async def run(
        self, token: str, key: str, print_: bytes, work: Callable[[Store], Awaitable[Reply]]
    ) -> tuple[Reply, bool]:
        """`work`'s reply and whether it was replayed; `work` gets the store bound to the transaction."""

        async def attempt(conn: psycopg.AsyncConnection) -> tuple[Reply, bool]:
            async with conn.transaction():
                cur = await conn.execute(self.q["claim"], [token, key, print_, self.window])
                if await cur.fetchone() is None:
                    return self._stored(await self._read(conn, token, key), print_), True
                reply = await work(self.store.bound(conn))
                stored = {"status": reply.status, "doc": reply.doc, "headers": reply.headers}
                await conn.execute(self.q["store"], [json.dumps(stored), token, key])
                return reply, False

        try:  # the caller's share of the pool and the time limit, as every call (backend.within)
            return await self.store.within(attempt)
        except (psycopg.OperationalError, psycopg.errors.QueryCanceled) as exc:
            raise StoreUnavailable(type(exc).__name__) from None

    async def _read(self, conn: psycopg.AsyncConnection, token: str, key: str) -> tuple[bytes, dict]:
        cur = await conn.execute(self.q["stored"], [token, key])
        row = await cur.fetchone()
        assert row is not None, "the claim found the key's row"
        return bytes(row[0]), row[1]

    def _stored(self, row: tuple[bytes, dict], print_: bytes) -> Reply:
        stored_print, stored = row
        if stored_print != print_:
            raise Problem(
                "idempotency-key-reused",
                "this Idempotency-Key was used for another request (method, path or body); use a new key",
                field="Idempotency-Key",
            )
        return Reply(int(stored["status"]), stored["doc"], dict(stored["headers"]))

    async def expire(self, chunk: int = 10_000) -> int:
        """Delete up to `chunk` expired keys; how many went."""
        try:
            async with asyncio.timeout(self.store.timeout), self.store.pool.connection() as conn:
                cur = await conn.execute(self.q["expire"], [chunk])
                return cur.rowcount
        except (psycopg.Error, TimeoutError) as exc:
            self._log.warning("expiring idempotency keys failed; will retry", error=str(exc))
            return 0
