"""A request's database work answers at its deadline, whatever the database does.

Cancelling a psycopg call does not end it at once: the driver first sends the server a cancel
request and waits for the query to stop (up to 5 s each), inside the cancelled call. When the
server does not answer at all (a network partition: packets dropped, nothing closed), a request
cancelled at `http.request_timeout` would answer some 10 s later. Here the work runs as a task of
its own: at the deadline the request stops waiting for it and answers, and the task is cancelled
and left to clean up (its connection closed, not reused) in the background.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_cleaning: set[asyncio.Task[Any]] = set()  # abandoned work still ending: kept from garbage collection


async def by_deadline(work: Coroutine[Any, Any, T], seconds: float) -> T:
    """`work`'s result, or TimeoutError once `seconds` have passed (the work then ends in the background)."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:  # the request itself was cancelled (a shutdown): so is its work
        _abandon(task)
        raise
    if task not in done:
        _abandon(task)
        raise TimeoutError
    return task.result()


def _abandon(task: asyncio.Task[Any]) -> None:
    task.cancel()
    _cleaning.add(task)
    task.add_done_callback(_ended)


def _ended(task: asyncio.Task[Any]) -> None:
    _cleaning.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: nobody waits for it any more, and asyncio would log it as lost


def cleaning() -> int:
    """How many abandoned calls are still ending (for tests)."""
    return len(_cleaning)
