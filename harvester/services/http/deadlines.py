"""Slow clients cannot hold a connection: deadlines for a request's headers and for its body.

uvicorn closes a keep-alive connection that stays silent, but a connection that sends nothing
after connecting, or half its headers, or a body a byte at a time, is kept for as long as the
client likes (a slowloris). This protocol gives each request a deadline for its headers (from the
connection, or from the end of the previous response) and then one for its body, and a client that
stops reading what it is sent gets the body deadline to start again; past any the connection is
closed. The deadlines are totals, not per read: trickling bytes does not extend them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from harvester.services.http import problems
from harvester.services.http.problems import Problem


class DeadlineProtocol(H11Protocol):
    header_timeout = 10.0
    body_timeout = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None  # while the client does not read
        self._waiting_for: str | None = None  # "headers" | "body" | None

    @classmethod
    def with_timeouts(cls, header_timeout: float, body_timeout: float) -> type[DeadlineProtocol]:
        """This protocol with the configured deadlines (uvicorn takes a protocol class)."""
        return type(
            "ConfiguredDeadlineProtocol", (cls,), {"header_timeout": header_timeout, "body_timeout": body_timeout}
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def pause_writing(self) -> None:
        # The client is not reading what we send: it gets body_timeout to start again.
        super().pause_writing()
        if self._stalled is None and not self.transport.is_closing():
            self._stalled = self.loop.call_later(self.body_timeout, self._expire_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _expire_stalled(self) -> None:
        self._stalled = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose client stopped reading its responses")
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # What h11 refuses (a malformed request line or header, an unknown Transfer-Encoding) gets
        # a problem document like every other refusal, not uvicorn's plain text. Its `instance` is
        # empty: the request's path is not known when its request line or headers cannot be read.
        problem = Problem(
            "invalid-request",
            "the request is not valid HTTP/1.1 (its request line, headers or framing)",
            field="headers",
        )
        body = bytes(problems.response(problem, "").body)
        response = h11.Response(
            status_code=400,
            headers=[
                (b"content-type", b"application/problem+json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
            reason=b"Bad Request",
        )
        try:
            output = self.conn.send(response) + self.conn.send(h11.Data(data=body)) + self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:  # already answering: nothing more can be said
            output = b""
        self.transport.write(output)
        self.transport.close()

    def _track(self) -> None:
        """Arm the deadline that fits what the client still owes us (none while we respond)."""
        state = self.conn.their_state
        owed = "headers" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if owed == self._waiting_for:
            return  # the same deadline keeps running: more bytes do not extend it
        self._cancel()
        self._waiting_for = owed
        if owed is not None and not self.transport.is_closing():
            timeout = self.header_timeout if owed == "headers" else self.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expire)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection that did not send its request's %s in time", self._waiting_for)
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True  # the app's receive() sees the client gone
                self.cycle.message_event.set()
            self.transport.close()
