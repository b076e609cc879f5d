"""The console's sign-in and sign-out: the login form, the login that trades a token for a session
cookie, and the logout that ends the session on every server.

The login form carries its own CSRF nonce (a double-submit cookie), since there is no session yet;
wrong tokens are limited per client address (with the API's).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from harvester.services.console import actions, logouts
from harvester.services.console.checks import Console
from harvester.services.console.session import COOKIE, LOGIN_COOKIE
from harvester.services.console.web import SECURITY_HEADERS, read_form, safe_next


def add_login_routes(r: APIRouter, console: Console) -> None:
    """GET and POST /console/login, POST /console/logout."""
    cfg, sessions, pages, db = console.cfg, console.sessions, console.pages, console.db
    schema = cfg.database.schema

    @r.get("/login")
    async def login_form(request: Request, next: str = "/console/") -> Response:
        nonce = request.cookies.get(LOGIN_COOKIE) or sessions.nonce()
        resp = pages.render(request, "login.html", None, next=safe_next(next), nonce=nonce, error=None)
        resp.set_cookie(LOGIN_COOKIE, nonce, httponly=True, samesite="strict", secure=_https(request), path="/console/")
        return resp

    @r.post("/login")
    async def login(request: Request) -> Response:
        form = await read_form(request) or {}
        nonce = request.cookies.get(LOGIN_COOKIE)
        target = safe_next(form.get("next"))
        if not nonce or not hmac.compare_digest(form.get("nonce", "").encode(), nonce.encode()):
            return pages.render(
                request,
                "login.html",
                None,
                403,
                next=target,
                nonce=nonce or sessions.nonce(),
                error="The form expired: try again.",
            )
        host = request.client.host if request.client else "-"
        got = sessions.login(form.get("token", ""))
        # Only a wrong token counts against the address; over its limit, a right token is let in
        # only if it signed in from there before, so the answer tells a guesser nothing.
        wait = console.logins.wrong(host) if got is None else console.logins.admits(host, got[0].token)
        if wait > 0:
            return pages.render(
                request, "login.html", None, 429, next=target, nonce=nonce, error="Too many attempts: wait a moment."
            )
        if got is None:
            return pages.render(
                request, "login.html", None, 401, next=target, nonce=nonce, error="That token is not valid."
            )
        user, cookie = got
        actions.audit.info("login", via="console", token=user.token, tenant=user.tenant, role=user.role)
        resp = RedirectResponse(
            target if user.sees_outbox else "/console/batches", status_code=303, headers=SECURITY_HEADERS
        )
        resp.set_cookie(
            COOKIE,
            cookie,
            max_age=int(cfg.console.session_ttl),
            httponly=True,
            samesite="strict",
            secure=_https(request),
            path="/console/",
        )
        resp.delete_cookie(LOGIN_COOKIE, path="/console/")
        return resp

    @r.post("/logout")
    async def logout(request: Request) -> Response:
        user = await console.signed_in(request)
        if user is not None:
            request.state.token = user.token
        form = await read_form(request) or {}
        if user is not None and not sessions.csrf_ok(user, form.get("csrf")):
            return pages.message(request, user, 403, "Refused", "The form's CSRF token is missing or wrong.")
        if user is not None and sessions.enabled:
            # Ended for every server, not only this browser: a copy of the cookie is refused too.
            await db.run(lambda c: logouts.record(c, schema, user.session, user.expires))
            actions.audit.info("logout", via="console", token=user.token, tenant=user.tenant, role=user.role)
        resp = RedirectResponse("/console/login", status_code=303, headers=SECURITY_HEADERS)
        resp.delete_cookie(COOKIE, path="/console/")
        return resp


def _https(request: Request) -> bool:
    return request.url.scheme == "https"
