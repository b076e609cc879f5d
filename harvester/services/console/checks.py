"""What every route module of the console is given: the Console (its configuration, sessions, pool,
pages and caches) and the checks a request passes before a route does anything.

A page needs a session not ended by a logout (harvester.services.console.logouts), else the login
page. An action is a POST from a confirmation page, checked in this order: a session (else the
login page), the CSRF token (403), the operator role (403); the route then makes its own checks.
A confirmation page refuses a viewer's token too (403), before it reads anything.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import Request
from starlette.responses import Response

from harvester.config import Config
from harvester.services.console import dead_acks, logouts
from harvester.services.console.overview import Cached, Gatherer
from harvester.services.console.session import Sessions, User
from harvester.services.console.web import Db, Pages, current_user, read_form, to_login
from harvester.services.http.security import WrongTokens
from tracker.ids import ID_MAX

Handler = Callable[[Request, User], Awaitable[Response]]  # a page, given its signed-in user
Endpoint = Callable[[Request], Awaitable[Response]]  # what the router calls
_CANONICAL_ID = re.compile(r"0|[1-9][0-9]{0,18}")


class Console:
    """One console's parts, made once and shared by all its routes; open() and close() its pool."""

    def __init__(self, cfg: Config, sessions: Sessions) -> None:
        self.cfg, self.sessions = cfg, sessions
        self.db = Db(cfg)
        self.pages = Pages(cfg, sessions)
        self.gatherer = Gatherer(cfg, self.db.thread)
        # Read from Kafka at most once a refresh, whoever asks.
        self.dead_acks = Cached(
            lambda: dead_acks.read(cfg, cfg.console.page_size), cfg.console.refresh_interval, self.db.thread
        )
        self.logins = WrongTokens()  # per client address: guessing tokens stays slow

    def open(self) -> None:
        self.db.open()

    def close(self) -> None:
        self.db.close()

    async def signed_in(self, request: Request) -> User | None:
        """The session's user, unless the session was ended by a logout (on any server)."""
        user = current_user(request, self.sessions)
        if user is None or not self.sessions.enabled:
            return user
        session, schema = user.session, self.cfg.database.schema
        if await self.db.run(lambda c: logouts.ended(c, schema, session)):
            return None
        return user

    def page(self, handler: Handler) -> Endpoint:
        """A page for a signed-in user; anyone else is sent to the login page."""

        async def wrapped(request: Request) -> Response:
            user = await self.signed_in(request)
            if user is None:
                return to_login(request)
            request.state.token = user.token  # the access log names who looked
            return await handler(request, user)

        return wrapped

    def confirmation(self, handler: Handler) -> Endpoint:
        """A confirmation page: the first step of an action, so a viewer's token is refused (403)
        before the handler reads anything."""

        async def for_operators(request: Request, user: User) -> Response:
            return self.operators_only(user, request) or await handler(request, user)

        return self.page(for_operators)

    def outbox_only(self, user: User, request: Request) -> Response | None:
        """None for an operator of the outbox; a tenant's token gets the refusal (403)."""
        if user.sees_outbox:
            return None
        return self.pages.message(
            request, user, 403, "Not for a tenant", "The outbox is shared: only operators see it."
        )

    def operators_only(self, user: User, request: Request) -> Response | None:
        """None for a token that may act; a viewer's gets the refusal (403)."""
        if user.may_act:
            return None
        return self.pages.message(
            request, user, 403, "Refused", "Your token may only look: acting needs an operator's."
        )

    async def action_form(self, request: Request) -> tuple[User, dict[str, str]] | Response:
        """An action's user and form once the session, the CSRF token and the role pass; else the refusal."""
        user = await self.signed_in(request)
        if user is None:
            return to_login(request)
        request.state.token = user.token  # the access log names who acted, refused or not
        form = await read_form(request)
        if form is None or not self.sessions.csrf_ok(user, form.get("csrf")):
            return self.pages.message(
                request, user, 403, "Refused", "The form's CSRF token is missing or wrong: reload the page."
            )
        if (refused := self.operators_only(user, request)) is not None:
            return refused
        return user, form


def whole_number(text: str | None, low: int = 0, high: int = ID_MAX) -> int | None:
    """A path or query parameter that is an id (low to high), else None. Written as the API takes
    ids: '0' or ASCII digits without a leading zero, no sign or spaces; so one batch has one URL."""
    t = text or ""
    if not _CANONICAL_ID.fullmatch(t) or not low <= int(t) <= high:
        return None
    return int(t)
