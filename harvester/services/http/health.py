"""/readyz without letting anonymous callers drive the database: one ping answers everyone for `ttl`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from harvester.services.http.backend import StoreUnavailable


class Readiness:
    """Whether the database answers, asked at most once per `ttl` seconds however many callers ask
    (callers arriving during a ping wait for that ping instead of starting their own)."""

    def __init__(
        self, ping: Callable[[], Awaitable[object]], ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._ping, self._ttl, self._clock = ping, ttl, clock
        self._known: tuple[float, bool] | None = None
        self._lock = asyncio.Lock()

    async def check(self) -> bool:
        known = self._known
        if known is not None and self._clock() - known[0] < self._ttl:
            return known[1]
        async with self._lock:
            known = self._known
            if known is not None and self._clock() - known[0] < self._ttl:
                return known[1]  # answered by the ping this caller waited for
            try:
                await self._ping()
                ok = True
            except (TimeoutError, StoreUnavailable, OSError):
                ok = False
            self._known = (self._clock(), ok)
            return ok
