"""Database connections held per tenant: one tenant's requests stuck on a lock (its own batch's row,
held by its application) cannot take the whole pool and stall every other tenant.

Guard names the caller's tenant (TENANT, a context variable, so the store's calls see it without
being told). A tenant's calls, all its tokens' together, past `http.max_connections_per_tenant`
(0: `http.pool_size - 1`) wait for one of its own to end, holding no connection meanwhile; one
still waiting at `http.request_timeout` is refused with 429 (backend.TenantBusy). The share is kept
below the pool's size, so while one tenant is stuck another always finds a connection (several
tenants stuck at once can still hold them all). Calls without a caller (the server's own: the
completion watcher, key expiry) are not counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar

TENANT: ContextVar[str | None] = ContextVar("reaper_http_tenant", default=None)


def tenant_share(pool_size: int, configured: int) -> int:
    """The connections one tenant may hold: `configured`, or 0 for pool_size - 1 (at least 1)."""
    return min(configured, pool_size) if configured > 0 else max(1, pool_size - 1)


class ConnectionsPerTenant:
    def __init__(self, limit: int) -> None:
        """`limit` 0: no cap."""
        self.limit = limit
        self._tenants: dict[str, tuple[asyncio.Semaphore, list[int]]] = {}  # tenant -> (its slots, [users])

    @asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """One of the caller's tenant's slots for as long as the block runs (waits for one if all are held)."""
        tenant = TENANT.get()
        if tenant is None or self.limit <= 0:
            yield
            return
        slots, users = self._tenants.setdefault(tenant, (asyncio.Semaphore(self.limit), [0]))
        users[0] += 1  # holders and waiters: the entry goes when the last one leaves
        try:
            async with slots:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._tenants[tenant]

    def held(self, tenant: str) -> int:
        """The calls of `tenant` holding or waiting for a slot."""
        entry = self._tenants.get(tenant)
        return entry[1][0] if entry else 0
