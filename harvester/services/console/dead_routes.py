"""The console's dead rows and dead-lettered acks: their pages, and requeueing them (one flow, two
kinds: harvester.services.console.requeues). Both are the outbox's, shared by every tenant: only an
operator of the outbox sees them, and only one with the operator role requeues.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from harvester.admin import acks as acks_admin
from harvester.admin import dead as dead_admin
from harvester.admin.common import AdminError
from harvester.exit_codes import ExitCode
from harvester.services.console import actions, queries, requeues
from harvester.services.console.actions import done_status
from harvester.services.console.checks import Console, whole_number
from harvester.services.console.session import User

Act = Callable[[User, requeues.Target], Awaitable[actions.Done]]  # a requeue's admin command


def add_dead_routes(r: APIRouter, console: Console) -> None:
    """/console/dead and /console/dead-acks, each with its /requeue confirmation page and action."""
    cfg, sessions, pages, db, page = console.cfg, console.sessions, console.pages, console.db, console.page
    outbox_only = console.outbox_only
    schema, table, size = cfg.database.schema, cfg.database.outbox_table, cfg.console.page_size

    @r.get("/dead")
    @page
    async def dead(request: Request, user: User) -> Response:
        if (refused := outbox_only(user, request)) is not None:
            return refused
        reason = request.query_params.get("reason", "")[:1000] or None
        after = whole_number(request.query_params.get("after", "0"))
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

    async def requeue_post(request: Request, flow: requeues.Flow, act: Act) -> Response:
        got = await console.action_form(request)
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
        return pages.render(request, "done.html", user, status=done_status(done), done=done, back=flow.path)

    # Before /dead/{dead_id}: registered after it, "requeue" would be taken for a dead row's id.
    @r.get("/dead/requeue")
    @console.confirmation
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
            return await actions.run(
                db, "dead-requeue", lambda c: actions.requeue(cfg, c, user, ids=ids, reason=t.reason)
            )

        return await requeue_post(request, requeues.DEAD, act)

    @r.get("/dead-acks")
    @page
    async def dead_acks(request: Request, user: User) -> Response:
        if (refused := outbox_only(user, request)) is not None:
            return refused
        found = await console.dead_acks.get()
        return pages.render(request, "dead_acks.html", user, d=found, limit=size)

    @r.get("/dead-acks/requeue")
    @console.confirmation  # it scans Kafka: never for a viewer
    async def requeue_acks_confirm(request: Request, user: User) -> Response:
        t = requeue_target(request, user, requeues.ACKS)
        if isinstance(t, Response):
            return t
        try:
            found = await db.thread(lambda: acks_admin.select(cfg, at=requeues.at_of(t), reason=t.reason))
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
        dead_id = whole_number(request.path_params["dead_id"], 1)
        row = None if dead_id is None else await db.run(lambda c: queries.dead_row(c, schema, table, dead_id))
        if row is None:
            return pages.message(request, user, 404, "No such dead row", "It was requeued, or never was dead.")
        return pages.render(request, "dead_row.html", user, row=row)
