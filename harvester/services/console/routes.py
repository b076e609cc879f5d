"""The console's routes: login, overview, batches, a batch, dead rows, dead-lettered acks, and the
three actions (expire a batch, requeue dead rows, requeue dead-lettered acks).

Every page reads with GET and works without JavaScript; live parts are also served alone as
fragments (`/console/fragments/...`), which console.js fetches every console.refresh_interval.
Every page and action needs a session not ended by a logout (harvester.services.console.logouts).
Actions are POSTs from a confirmation page, checked in this order: a session (else the login page),
the CSRF token (403), the operator role (403), then the admin command's own checks.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any

import psycopg
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import RedirectResponse, Response

from harvester.admin import acks as acks_admin
from harvester.admin import batch as batch_admin
from harvester.admin import dead as dead_admin
from harvester.admin.common import AdminError
from harvester.config import Config
from harvester.exit_codes import ExitCode
from harvester.services.console import actions, batch_page, logouts, queries, requeues
from harvester.services.console import dead_acks as dead_acks_mod
from harvester.services.console.overview import Cached, Gatherer
from harvester.services.console.session import COOKIE, LOGIN_COOKIE, Sessions, User
from harvester.services.console.web import SECURITY_HEADERS, Db, Pages, current_user, read_form, safe_next, to_login
from harvester.services.http.security import RateLimiter
from tracker.errors import MalformedItemId, TrackerError
from tracker.ids import ID_MAX, ItemId, parse_item_id

VIEWS = ("unfinished", "open", "closed", "finished")
_STATIC = {"console.css": "text/css", "console.js": "text/javascript"}
Ctx = dict[str, Any]  # a template's context
_CURSOR = re.compile(r"[0-9]{1,19}|[0-9T:.+-]{10,40}~[0-9]{1,19}")


class Console:
    def __init__(self, cfg: Config, sessions: Sessions) -> None:
        self.cfg, self.sessions = cfg, sessions
        self.db = Db(cfg)
        self.pages = Pages(cfg, sessions)
        self.gatherer = Gatherer(cfg)
        # Read from Kafka at most once a refresh, whoever asks.
        self.dead_acks = Cached(lambda: dead_acks_mod.read(cfg, cfg.console.page_size), cfg.console.refresh_interval)
        self.logins = RateLimiter(1.0, 10)  # per client address: guessing tokens stays slow

    def open(self) -> None:
        self.db.open()

    def close(self) -> None:
        self.db.close()


def _int(text: str | None, low: int = 0, high: int = ID_MAX) -> int | None:
    t = (text or "").strip()
    if not t.isascii() or not t.isdigit() or len(t) > 19 or not low <= int(t) <= high:
        return None
    return int(t)


class _BadCursor(ValueError):
    pass


def _item(text: str | None) -> ItemId | None:
    """An item id cursor (None: from the start); _BadCursor when it is malformed."""
    if not text:
        return None
    try:
        return parse_item_id(text)
    except (MalformedItemId, TrackerError):
        raise _BadCursor(text) from None


def add_console(app: FastAPI, cfg: Config, sessions: Sessions) -> Console:
    console = Console(cfg, sessions)
    pages, db = console.pages, console.db
    schema, table, size = cfg.database.schema, cfg.database.outbox_table, cfg.console.page_size
    r = APIRouter(prefix="/console", include_in_schema=False)

    async def signed_in(request: Request) -> User | None:
        """The session's user, unless the session was ended by a logout (on any server)."""
        user = current_user(request, sessions)
        if user is None or not sessions.enabled:
            return user
        if await db.run(lambda c: logouts.ended(c, schema, user.session)):
            return None
        return user

    def page(handler: Callable[[Request, User], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def wrapped(request: Request) -> Response:
            user = await signed_in(request)
            if user is None:
                return to_login(request)
            request.state.token = user.token  # the access log names who looked
            return await handler(request, user)

        return wrapped

    def outbox_only(user: User, request: Request) -> Response | None:
        if user.sees_outbox:
            return None
        return pages.message(request, user, 403, "Not for a tenant", "The outbox is shared: only operators see it.")

    async def action_form(request: Request) -> tuple[User, dict[str, str]] | Response:
        user = await signed_in(request)
        if user is None:
            return to_login(request)
        form = await read_form(request)
        if form is None or not sessions.csrf_ok(user, form.get("csrf")):
            return pages.message(
                request, user, 403, "Refused", "The form's CSRF token is missing or wrong: reload the page."
            )
        if not user.may_act:
            return pages.message(request, user, 403, "Refused", "Your token may only look: acting needs an operator's.")
        return user, form

    # ------------------------------------------------------------------ login

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
        if console.logins.take(host) > 0:
            return pages.render(
                request, "login.html", None, 429, next=target, nonce=nonce, error="Too many attempts: wait a moment."
            )
        got = sessions.login(form.get("token", ""))
        if got is None:
            return pages.render(
                request, "login.html", None, 401, next=target, nonce=nonce, error="That token is not valid."
            )
        user, cookie = got
        actions.audit.info("login", via="console", token=user.token, tenant=user.tenant, role=user.role)
        resp = RedirectResponse(target if user.sees_outbox else "/console/batches", status_code=303)
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
        user = await signed_in(request)
        form = await read_form(request) or {}
        if user is not None and not sessions.csrf_ok(user, form.get("csrf")):
            return pages.message(request, user, 403, "Refused", "The form's CSRF token is missing or wrong.")
        if user is not None and sessions.enabled:
            # Ended for every server, not only this browser: a copy of the cookie is refused too.
            await db.run(lambda c: logouts.record(c, schema, user.session, user.expires))
            actions.audit.info("logout", via="console", token=user.token, tenant=user.tenant, role=user.role)
        resp = RedirectResponse("/console/login", status_code=303)
        resp.delete_cookie(COOKIE, path="/console/")
        return resp

    # ------------------------------------------------------------------ overview

    async def overview_ctx() -> Ctx:
        return {"o": await console.gatherer.gather(db.run), "cfg": cfg}

    @r.get("/")
    @page
    async def overview(request: Request, user: User) -> Response:
        if not user.sees_outbox:  # a tenant's token: its batches are its overview
            return RedirectResponse("/console/batches", status_code=303)
        return pages.render(request, "overview.html", user, **await overview_ctx())

    @r.get("/fragments/overview")
    @page
    async def overview_live(request: Request, user: User) -> Response:
        if (refused := outbox_only(user, request)) is not None:
            return refused
        return pages.render(request, "_overview.html", user, **await overview_ctx())

    # ------------------------------------------------------------------ batches

    async def batches_ctx(request: Request, user: User) -> Ctx | Response:
        view = request.query_params.get("view", "unfinished")
        q = request.query_params.get("q", "").strip()[:200]
        cursor = request.query_params.get("before") or None
        if view not in VIEWS or (cursor is not None and not _CURSOR.fullmatch(cursor)) or "\x00" in q:
            return pages.message(request, user, 400, "Bad request", "Unknown view, cursor or search text.")
        if q:
            rows = await db.run(lambda c: queries.search(c, schema, user.tenant, q, size))
            found = queries.BatchPage(rows, None)
        else:
            try:
                found = await db.run(
                    lambda c: queries.batches(c, schema, user.tenant, view=view, cursor=cursor, limit=size)
                )
            except ValueError:
                return pages.message(request, user, 400, "Bad request", "That cursor is not one this page made.")
        return {"view": view, "q": q, "page": found, "cursor": cursor, "views": VIEWS}

    @r.get("/batches")
    @page
    async def batches(request: Request, user: User) -> Response:
        ctx = await batches_ctx(request, user)
        return ctx if isinstance(ctx, Response) else pages.render(request, "batches.html", user, **ctx)

    @r.get("/fragments/batches")
    @page
    async def batches_live(request: Request, user: User) -> Response:
        ctx = await batches_ctx(request, user)
        return ctx if isinstance(ctx, Response) else pages.render(request, "_batches.html", user, **ctx)

    async def batch_ctx(request: Request, user: User, batch_id: int) -> Ctx | Response:
        try:
            after, failures_after = _item(request.query_params.get("after")), _item(request.query_params.get("fafter"))
        except _BadCursor:
            return pages.message(request, user, 400, "Bad request", "A page cursor is not an item id.")

        def read(c: psycopg.Connection) -> tuple[batch_admin.BatchView, list[queries.BatchRow]] | None:
            return batch_page.read(
                c, schema, user.tenant, batch_id, after=after, failures_after=failures_after, limit=size
            )

        try:
            got = await db.run(read)
        except batch_page.BadCursor:
            return pages.message(request, user, 400, "Bad request", "A page cursor is not an item id of this batch.")
        if got is None:
            return pages.message(request, user, 404, "No such batch", f"There is no batch {batch_id}.")
        view, kids = got
        return {"b": view, "children": kids, "after": request.query_params.get("after")}

    @r.get("/batches/{batch_id}")
    @page
    async def batch(request: Request, user: User) -> Response:
        batch_id = _int(request.path_params["batch_id"])
        if batch_id is None:
            return pages.message(request, user, 404, "No such batch", "A batch id is a whole number.")
        ctx = await batch_ctx(request, user, batch_id)
        return ctx if isinstance(ctx, Response) else pages.render(request, "batch.html", user, **ctx)

    @r.get("/fragments/batches/{batch_id}")
    @page
    async def batch_live(request: Request, user: User) -> Response:
        batch_id = _int(request.path_params["batch_id"])
        if batch_id is None:
            return pages.message(request, user, 404, "No such batch", "A batch id is a whole number.")
        ctx = await batch_ctx(request, user, batch_id)
        return ctx if isinstance(ctx, Response) else pages.render(request, "_batch.html", user, **ctx)

    @r.get("/batches/{batch_id}/expire")
    @page
    async def expire_confirm(request: Request, user: User) -> Response:
        batch_id = _int(request.path_params["batch_id"])
        ctx = None if batch_id is None else await batch_ctx(request, user, batch_id)
        if ctx is None or isinstance(ctx, Response):
            return ctx or pages.message(request, user, 404, "No such batch", "A batch id is a whole number.")
        return pages.render(request, "confirm_expire.html", user, **ctx)

    @r.post("/batches/{batch_id}/expire")
    async def expire(request: Request) -> Response:
        got = await action_form(request)
        if isinstance(got, Response):
            return got
        user, form = got
        batch_id = _int(request.path_params["batch_id"])
        note = form.get("note", "").strip()[:1000] or None
        if batch_id is None or (note is not None and "\x00" in note):
            return pages.message(request, user, 400, "Bad request", "A batch id is a whole number; a note has no NUL.")
        owner = await db.run(lambda c: queries.tenant_of(c, schema, batch_id))
        if owner != user.tenant:
            return pages.message(request, user, 404, "No such batch", f"There is no batch {batch_id}.")
        done = await db.run(lambda c: actions.expire(cfg, c, user, batch_id, note))
        return pages.render(
            request, "done.html", user, status=200 if done.ok else 409, done=done, back=f"/console/batches/{batch_id}"
        )

    # ------------------------------------------------------------------ dead rows

    @r.get("/dead")
    @page
    async def dead(request: Request, user: User) -> Response:
        if (refused := outbox_only(user, request)) is not None:
            return refused
        reason = request.query_params.get("reason", "")[:1000] or None
        after = _int(request.query_params.get("after", "0"))
        if after is None or (reason and "\x00" in reason):
            return pages.message(request, user, 400, "Bad request", "`after` is a dead row id; a reason has no NUL.")
        found = await db.run(
            lambda c: dead_admin.list_dead(
                c, schema, table, reason=reason, after=after, limit=size, count_cap=queries.DEAD_COUNT_CAP
            )
        )
        return pages.render(
            request, "dead.html", user, page=found, reason=reason or "", after=after, cap=queries.DEAD_COUNT_CAP
        )

    # ------------------------------------------------------------------ requeues (one flow, two kinds)

    def requeue_target(request: Request, user: User, flow: requeues.Flow) -> requeues.Target | Response:
        """A confirmation page's target, or the answer refusing it."""
        if (refused := outbox_only(user, request)) is not None:
            return refused
        t = flow.target(request.query_params)
        return t if t.named else pages.message(request, user, 400, "Bad request", flow.nothing)

    def confirm_page(request: Request, user: User, flow: requeues.Flow, t: requeues.Target, **ctx: Any) -> Response:
        template = "confirm_requeue.html" if flow is requeues.DEAD else "confirm_requeue_acks.html"
        confirm = sessions.confirmation(user, flow.confirmation_key(t))
        return pages.render(request, template, user, flow=flow, t=t, confirm=confirm, **ctx)

    async def requeue_post(
        request: Request, flow: requeues.Flow, act: Callable[[User, requeues.Target], Awaitable[actions.Done]]
    ) -> Response:
        got = await action_form(request)
        if isinstance(got, Response):
            return got
        user, form = got
        if not user.sees_outbox:
            return pages.message(request, user, 403, "Refused", flow.shared)
        t = flow.target(form)
        if not t.named:
            return pages.message(request, user, 400, "Bad request", flow.nothing)
        if not sessions.confirmation_ok(user, flow.confirmation_key(t), form.get("confirm")):
            return pages.message(request, user, 403, "Refused", flow.unconfirmed)
        done = await act(user, t)
        return pages.render(request, "done.html", user, status=200 if done.ok else 409, done=done, back=flow.path)

    @r.get("/dead/requeue")
    @page
    async def requeue_confirm(request: Request, user: User) -> Response:
        t = requeue_target(request, user, requeues.DEAD)
        if isinstance(t, Response):
            return t
        rows: list[dead_admin.DeadRow] = []
        if t.one is not None:
            one = int(t.one)
            found = await db.run(lambda c: dead_admin.list_dead(c, schema, table, after=one - 1, limit=1))
            rows = [row for row in found.rows if row.id == one]
            count = len(rows)
        else:
            count = (
                await db.run(
                    lambda c: dead_admin.list_dead(
                        c, schema, table, reason=t.reason, limit=1, count_cap=queries.DEAD_COUNT_CAP
                    )
                )
            ).matching
        return confirm_page(request, user, requeues.DEAD, t, count=count, rows=rows, cap=queries.DEAD_COUNT_CAP)

    @r.post("/dead/requeue")
    async def requeue(request: Request) -> Response:
        async def act(user: User, t: requeues.Target) -> actions.Done:
            ids = None if t.one is None else [int(t.one)]
            return await db.run(lambda c: actions.requeue(cfg, c, user, ids=ids, reason=t.reason))

        return await requeue_post(request, requeues.DEAD, act)

    @r.get("/dead-acks")
    @page
    async def dead_acks(request: Request, user: User) -> Response:
        if (refused := outbox_only(user, request)) is not None:
            return refused
        found = await console.dead_acks.get()
        return pages.render(request, "dead_acks.html", user, d=found, limit=size)

    @r.get("/dead-acks/requeue")
    @page
    async def requeue_acks_confirm(request: Request, user: User) -> Response:
        t = requeue_target(request, user, requeues.ACKS)
        if isinstance(t, Response):
            return t
        try:
            found = await asyncio.to_thread(acks_admin.select, cfg, at=requeues.at_of(t), reason=t.reason)
        except AdminError as exc:
            missing = exc.code == ExitCode.NOT_FOUND
            return pages.message(
                request, user, 404 if missing else 503, "No such dead letter" if missing else "Kafka", str(exc)
            )
        chosen, scanned, skipped = found
        return confirm_page(
            request,
            user,
            requeues.ACKS,
            t,
            letters=[acks_admin.dead_ack(m) for m in chosen[: acks_admin.SHOWN]],
            count=len(chosen),
            scanned=scanned,
            skipped=skipped,
            topic=", ".join(sorted({acks_admin.destination(cfg, m) for m in chosen})) or cfg.acker.topic,
        )

    @r.post("/dead-acks/requeue")
    async def requeue_acks(request: Request) -> Response:
        async def act(user: User, t: requeues.Target) -> actions.Done:
            # Holds no database connection while Kafka is read and written (actions.requeue_acks).
            return await actions.requeue_acks(cfg, db, user, at=requeues.at_of(t), reason=t.reason)

        return await requeue_post(request, requeues.ACKS, act)

    @r.get("/dead/{dead_id}")
    @page
    async def dead_one(request: Request, user: User) -> Response:
        if (refused := outbox_only(user, request)) is not None:
            return refused
        dead_id = _int(request.path_params["dead_id"], 1)
        row = None if dead_id is None else await db.run(lambda c: queries.dead_row(c, schema, table, dead_id))
        if row is None:
            return pages.message(request, user, 404, "No such dead row", "It was requeued, or never was dead.")
        return pages.render(request, "dead_row.html", user, row=row)

    # ------------------------------------------------------------------ static files

    @r.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in _STATIC:
            return Response("not found\n", status_code=404, media_type="text/plain")
        body = files("harvester.services.console").joinpath("static", name).read_bytes()
        headers = {**SECURITY_HEADERS, "Cache-Control": "public, max-age=300"}
        return Response(body, media_type=_STATIC[name], headers=headers)

    @app.get("/console", include_in_schema=False)
    async def console_root() -> Response:
        return RedirectResponse("/console/", status_code=308)

    app.include_router(r)
    return console


def _https(request: Request) -> bool:
    return request.url.scheme == "https"
