"""Open long-polls and event streams, capped per token: one client cannot hold every connection."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable

from starlette.responses import StreamingResponse

from harvester.services.http.problems import Problem
from harvester.services.http.security import Receive, Scope, Send


class WaitsPerToken:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}

    def hold(self, token: str) -> Callable[[], None]:
        """Count one more open wait for `token`, or raise the 429 problem; returns its release."""
        held = self._open.get(token, 0)
        if held >= self.limit:
            raise Problem(
                "rate-limited",
                f"token {token} already holds {held} open long-polls and event streams (the limit); close one first",
                headers={"Retry-After": "1"},
                limit=self.limit,
            )
        self._open[token] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self._open[token] - 1
                if left:
                    self._open[token] = left
                else:
                    del self._open[token]

        return release

    def held(self, token: str) -> int:
        return self._open.get(token, 0)


class HeldStream(StreamingResponse):
    """A streaming response that releases its wait when it ends, however it ends."""

    def __init__(self, content: AsyncIterable[bytes], release: Callable[[], None], **kwargs: object) -> None:
        super().__init__(content, **kwargs)  # type: ignore[arg-type]
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
