"""The API's CPU work off the event loop (parsing a large body, folding a large ack), on threads of
its own: not the loop's default executor, which name resolution and other libraries share, nor the
console's (which waits on the database). A few threads: the work holds the GIL, so more would not
go faster, only let more requests' work interleave."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREADS = 2


class CpuThreads:
    def __init__(self, threads: int = THREADS) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="reaper-http-cpu")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on one of these threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
