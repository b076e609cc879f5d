"""The console's routes put together: the overview and the static files here, and each group of
pages and actions from its own module: login_routes.py (sign-in and sign-out), batch_routes.py
(batches, a batch, expiring it), dead_routes.py (dead rows and dead-lettered acks, requeueing them).
What they share, and the checks every page and action passes first, are in checks.py.

Every page reads with GET and works without JavaScript; live parts are also served alone as
fragments (`/console/fragments/...`), which console.js fetches every console.refresh_interval.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from starlette.responses import RedirectResponse, Response

from harvester.config import Config
from harvester.services.console.batch_routes import add_batch_routes
from harvester.services.console.checks import Console
from harvester.services.console.dead_routes import add_dead_routes
from harvester.services.console.login_routes import add_login_routes
from harvester.services.console.session import Sessions, User
from harvester.services.console.web import SECURITY_HEADERS, ConsoleUnavailable, Ctx

_STATIC = {"console.css": "text/css", "console.js": "text/javascript"}


def add_console(app: FastAPI, cfg: Config, sessions: Sessions) -> Console:
    console = Console(cfg, sessions)
    r = APIRouter(prefix="/console", include_in_schema=False)
    add_login_routes(r, console)
    _add_overview_routes(r, console)
    add_batch_routes(r, console)
    add_dead_routes(r, console)

    @r.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in _STATIC:
            return Response("not found\n", status_code=404, media_type="text/plain", headers=SECURITY_HEADERS)
        body = files("harvester.services.console").joinpath("static", name).read_bytes()
        headers = {**SECURITY_HEADERS, "Cache-Control": "public, max-age=300"}
        return Response(body, media_type=_STATIC[name], headers=headers)

    @app.exception_handler(ConsoleUnavailable)
    async def unavailable(request: Request, exc: ConsoleUnavailable) -> Response:
        # as the API's 503 (unavailable, Retry-After), not a crash: the page works again with the database
        page = console.pages.message(
            request, None, 503, "Database unavailable", f"The database is unavailable ({exc}); retry in a moment."
        )
        page.headers["Retry-After"] = "1"
        return page

    @app.get("/console", include_in_schema=False)
    async def console_root() -> Response:
        return RedirectResponse("/console/", status_code=308, headers=SECURITY_HEADERS)

    app.include_router(r)
    return console


def _add_overview_routes(r: APIRouter, console: Console) -> None:
    """The overview (/console/) and its fragment: the outbox's, so an operator's of the outbox."""
    pages, page = console.pages, console.page

    async def overview_ctx() -> Ctx:
        return {"o": await console.gatherer.gather(console.db.run), "cfg": console.cfg}

    @r.get("/")
    @page
    async def overview(request: Request, user: User) -> Response:
        if not user.sees_outbox:  # a tenant's token: its batches are its overview
            return RedirectResponse("/console/batches", status_code=303, headers=SECURITY_HEADERS)
        return pages.render(request, "overview.html", user, **await overview_ctx())

    @r.get("/fragments/overview")
    @page
    async def overview_live(request: Request, user: User) -> Response:
        if (refused := console.outbox_only(user, request)) is not None:
            return refused
        return pages.render(request, "_overview.html", user, **await overview_ctx())
