"""The console's batches: the list (by view, or a search), one batch with its children and failures,
and the action that expires a batch. A tenant's token sees and expires only its tenant's batches.
"""

from __future__ import annotations

import re

import psycopg
from fastapi import APIRouter, Request
from starlette.responses import Response

from harvester.admin import batch as batch_admin
from harvester.services.console import actions, batch_page, queries
from harvester.services.console.actions import done_status
from harvester.services.console.checks import Console, whole_number
from harvester.services.console.session import User
from harvester.services.console.web import Ctx
from tracker.errors import MalformedItemId, TrackerError
from tracker.ids import ItemId, parse_item_id

VIEWS = ("unfinished", "open", "closed", "finished")
_CURSOR = re.compile(r"[0-9]{1,19}|[0-9T:.+-]{10,40}~[0-9]{1,19}")


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


def add_batch_routes(r: APIRouter, console: Console) -> None:
    """The batch pages and their fragments under /console/batches, and the expire action."""
    cfg, pages, db, page = console.cfg, console.pages, console.db, console.page
    schema, size = cfg.database.schema, cfg.console.page_size

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
        return {
            "b": view,
            "children": kids,
            "after": request.query_params.get("after"),
            "fafter": request.query_params.get("fafter"),
        }

    async def batch_in(template: str, request: Request, user: User) -> Response:
        """The batch of the path rendered with `template` (the page, or its live fragment)."""
        batch_id = whole_number(request.path_params["batch_id"])
        if batch_id is None:
            return pages.message(request, user, 404, "No such batch", "A batch id is a whole number.")
        ctx = await batch_ctx(request, user, batch_id)
        return ctx if isinstance(ctx, Response) else pages.render(request, template, user, **ctx)

    @r.get("/batches/{batch_id}")
    @page
    async def batch(request: Request, user: User) -> Response:
        return await batch_in("batch.html", request, user)

    @r.get("/fragments/batches/{batch_id}")
    @page
    async def batch_live(request: Request, user: User) -> Response:
        return await batch_in("_batch.html", request, user)

    @r.get("/batches/{batch_id}/expire")
    @console.confirmation
    async def expire_confirm(request: Request, user: User) -> Response:
        batch_id = whole_number(request.path_params["batch_id"])
        ctx = None if batch_id is None else await batch_ctx(request, user, batch_id)
        if ctx is None or isinstance(ctx, Response):
            return ctx or pages.message(request, user, 404, "No such batch", "A batch id is a whole number.")
        return pages.render(request, "confirm_expire.html", user, **ctx)

    @r.post("/batches/{batch_id}/expire")
    async def expire(request: Request) -> Response:
        got = await console.action_form(request)
        if isinstance(got, Response):
            return got
        user, form = got
        batch_id = whole_number(request.path_params["batch_id"])
        note = form.get("note", "").strip()[:1000] or None
        if batch_id is None or (note is not None and "\x00" in note):
            return pages.message(request, user, 400, "Bad request", "A batch id is a whole number; a note has no NUL.")
        owner = await db.run(lambda c: queries.tenant_of(c, schema, batch_id))
        if owner != user.tenant:
            return pages.message(request, user, 404, "No such batch", f"There is no batch {batch_id}.")
        done = await actions.run(db, "batch-expire", lambda c: actions.expire(cfg, c, user, batch_id, note))
        return pages.render(
            request, "done.html", user, status=done_status(done), done=done, back=f"/console/batches/{batch_id}"
        )
