"""Database connections held per token: one tenant's requests stuck on a lock (its own batch's row,
held by its application) cannot take the whole pool and stall every other tenant.

Guard names the caller (CALLER, a context variable, so the store's calls see it without being told).
A token's calls past `http.max_connections_per_token` wait for one of its own to end, holding no
connection meanwhile; one still waiting at `http.request_timeout` is refused with 429 (backend.TokenBusy).
Calls without a caller (the server's own: the completion watcher, key expiry) are not counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

CALLER: ContextVar[str | None] = ContextVar("reaper_http_caller", default=None)


class ConnectionsPerToken:
    def __init__(self, limit: int) -> None:
        """`limit` 0: no cap."""
        self.limit = limit
        self._tokens: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # token -> (its slots, [users])

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """One of the caller's slots for as long as the block runs (waits for one if all are held)."""
        token = CALLER.get()
        if token is None or self.limit <= 0:
            yield
            return
        slots, users = self._tokens.setdefault(token, (asyncio.Semaphore(self.limit), [0]))
        users[0] += 1  # holders and waiters: the entry goes when the last one leaves
        try:
            async with slots:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._tokens[token]

    def held(self, token: str) -> int:
        """The calls of `token` holding or waiting for a slot."""
        entry = self._tokens.get(token)
        return entry[1][0] if entry else 0
