"""Completion without client polling: long-poll waiters on batches, woken by this server's own
closes and acks at once, and by one batched query (for every batch anyone waits on) every
`interval` seconds for completions made elsewhere (the Kafka acker, SQL clients, other servers)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

Finished = Callable[[list[int]], Awaitable[set[int]]]


class CompletionWatcher:
    def __init__(self, finished: Finished, interval: float) -> None:
        self._finished, self._interval = finished, interval
        self._waiters: dict[int, set[asyncio.Event]] = {}
        self._task: asyncio.Task | None = None
        self._closing = asyncio.Event()
        self._log = structlog.get_logger("reaper.http")

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="completion-watcher")

    async def stop(self) -> None:
        self.release_all()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def release_all(self) -> None:
        """Wake every waiter (shutdown): they answer with the batch's current state."""
        self._closing.set()
        for events in self._waiters.values():
            for e in events:
                e.set()

    def notify(self, batch_ids: list[int]) -> None:
        for b in batch_ids:
            for e in self._waiters.get(b, ()):
                e.set()

    async def wait(self, batch_id: int, timeout: float) -> None:
        """Return when the batch may have finished, at shutdown, or after `timeout` seconds."""
        if self._closing.is_set():
            return
        event = asyncio.Event()
        self._waiters.setdefault(batch_id, set()).add(event)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            events = self._waiters.get(batch_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiters[batch_id]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if not self._waiters:
                continue
            try:
                done = await self._finished(list(self._waiters))
            except Exception as exc:  # the next round tries again; waiters time out meanwhile
                self._log.warning("completion check failed", error=type(exc).__name__)
                continue
            self.notify(sorted(done))
