"""The gate in front of the app: every request framed one way only; /v1 requests with exactly one
valid bearer token, within its rate limit, and JSON bodies. Refusals are problem documents."""

from __future__ import annotations

from collections.abc import Callable

from harvester.services.http import problems
from harvester.services.http.problems import Problem
from harvester.services.http.security import (
    RateLimiter,
    Receive,
    Scope,
    Send,
    WrongTokens,
    headers_of,
    loopback_host,
    state_of,
)
from harvester.services.http.tenants import TenantAuth
from harvester.services.http.token_connections import TENANT


async def send_problem(scope: Scope, receive: Receive, send: Send, problem: Problem) -> None:
    state_of(scope)["problem"] = problem.slug
    await problems.response(problem, str(scope.get("path", "")))(scope, receive, send)


class Guard:
    """Every request framed one way only; /v1: one valid bearer token, within its rate; POST
    bodies must be JSON."""

    def __init__(
        self,
        app: Callable,
        auth: TenantAuth,
        limiter: RateLimiter,
        open_paths: set[str],
        api: bool = True,
        guesses: WrongTokens | None = None,
    ) -> None:
        """`api=False`: an app with no /v1 (the console alone): framing and the local-mode Host only.
        `guesses`: wrong tokens per client address (shared with the console's logins): past it, a
        wrong token, or a right one not used from that address before, is refused with 429 until
        the bucket refills, so that guessing stays as slow as the console's login makes it."""
        self.app, self.auth, self.limiter, self.open_paths, self.api = app, auth, limiter, open_paths, api
        self.guesses = guesses

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = [name for name, _ in headers_of(scope)]
        if b"transfer-encoding" in names and b"content-length" in names:
            # Framed two ways: a proxy in front may have read it the other way, and what follows
            # could be a request it never saw. Refused, and the connection closed after it.
            await send_problem(
                scope,
                receive,
                send,
                Problem(
                    "invalid-request",
                    "the request has both Content-Length and Transfer-Encoding",
                    field="headers",
                    headers={"Connection": "close"},
                ),
            )
            return
        host = dict(headers_of(scope)).get(b"host")
        if not self.auth.enabled and not loopback_host(host):
            # Local mode asks no token: only requests addressed to this machine's own names.
            await send_problem(
                scope,
                receive,
                send,
                Problem(
                    "misdirected-request",
                    "without tokens (http.local_mode) only requests whose Host is localhost or a loopback "
                    f"address are answered, not {(host or b'').decode('latin-1')[:100]!r}",
                    field="headers",
                ),
            )
            return
        path = str(scope.get("path", ""))
        if not self.api or not path.startswith("/v1/") or path in self.open_paths:
            await self.app(scope, receive, send)
            return
        if names.count(b"authorization") > 1:
            await send_problem(
                scope,
                receive,
                send,
                Problem("invalid-request", "the request has more than one Authorization header", field="headers"),
            )
            return
        headers = dict(headers_of(scope))
        raw = headers.get(b"authorization")
        self.auth.maybe_reload()
        client = scope.get("client")
        address = str(client[0]) if isinstance(client, list | tuple) and client else "-"
        caller = self.auth.identify(raw)  # its bytes, as the client sent them
        if raw is not None and self.guesses is not None:
            # Only a wrong token counts; over the limit, a right one passes only if it has been
            # used from this address before, so the 429 tells a guesser nothing.
            wait = self.guesses.wrong(address) if caller is None else self.guesses.admits(address, caller.token)
            if wait > 0:
                await send_problem(scope, receive, send, _rate_limited("too many wrong tokens from this address", wait))
                return
        if caller is None:
            why = "no Authorization: Bearer header" if raw is None else "the bearer token is not valid"
            await send_problem(
                scope,
                receive,
                send,
                Problem("unauthorized", why, headers={"WWW-Authenticate": 'Bearer realm="reaper"'}),
            )
            return
        token = caller.token
        TENANT.set(caller.tenant.name)  # the store counts this request's connections against its tenant
        state_of(scope)["token"] = token
        state_of(scope)["tenant"] = caller.tenant
        state_of(scope)["scope"] = caller.scope
        wait = self.limiter.take(token)
        if wait > 0:
            await send_problem(scope, receive, send, _rate_limited(f"token {token} is over its rate limit", wait))
            return
        if scope.get("method") == "POST":
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            has_body = headers.get(b"content-length", b"0") not in (b"0", b"") or b"transfer-encoding" in headers
            if has_body and ctype != b"application/json":
                await send_problem(
                    scope,
                    receive,
                    send,
                    Problem(
                        "unsupported-media-type",
                        f"Content-Type {ctype.decode('latin-1') or '(none)'!r}: send application/json",
                        field="Content-Type",
                    ),
                )
                return
        await self.app(scope, receive, send)


def _rate_limited(why: str, wait: float) -> Problem:
    """The 429 for `why`, saying when to come back (Retry-After in whole seconds, rounded up)."""
    return Problem(
        "rate-limited",
        f"{why}; retry after {wait:.3f} s",
        headers={"Retry-After": str(max(1, int(wait + 0.999)))},
        retry_after=round(wait, 3),
    )
