"""The console's actions: the admin commands' own functions (harvester.admin.dead, .batch, .acks),
with their checks, plus one audit line naming who acted. Each also records itself in `admin_log`, in
the transaction that does it, exactly as the command does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psycopg
import structlog

from harvester.admin import acks as acks_admin
from harvester.admin import batch as batch_admin
from harvester.admin import dead as dead_admin
from harvester.admin.common import AdminError
from harvester.config import Config
from harvester.publishing.publisher import logs_safe
from harvester.services.console.session import User
from harvester.services.console.web import ActionStopped, Db, StillRunning

audit = structlog.get_logger("reaper.audit")


@dataclass
class Done:
    ok: bool
    message: str
    running: bool = False  # still going past the page's deadline (202): its audit line tells the end
    stopped: bool = False  # started, then failed on the database (503)

    @property
    def heading(self) -> str:
        return "Still running" if self.running else "Stopped" if self.stopped else "Done" if self.ok else "Refused"


def done_status(done: Done) -> int:
    """The page's status: 202 still running, 200 done, 503 stopped by the database, 409 refused."""
    return 202 if done.running else 200 if done.ok else 503 if done.stopped else 409


async def run(db: Db, action: str, fn: Callable[[psycopg.Connection], Done]) -> Done:
    """An action on the console's database threads (Db.act): past the page's deadline the page says
    it is still running, not that the database is unavailable; a database error once it started
    says that it stopped, and that what it committed before stays."""
    try:
        return await db.act(fn)
    except StillRunning:
        return Done(
            True,
            f"Still running after {db.timeout:g} s: it goes on to its end on the server. The audit log "
            f"(reaper.audit, action {action}) and the admin log will say how it ended; reload the page to "
            "see what it has done so far. Do not start it again.",
            running=True,
        )
    except ActionStopped as exc:
        return Done(
            False,
            f"It stopped: the database answered {logs_safe(exc.error)}. What it committed before that "
            "stays (a requeue of many rows commits in chunks): reload the page to see what is left.",
            stopped=True,
        )


def _log(user: User, action: str, outcome: str, **detail: object) -> None:
    audit.info(
        "audit",
        via="console",
        action=action,
        outcome=outcome,
        token=user.token,
        tenant=user.tenant,
        role=user.role,
        session=user.session[:8],
        **detail,
    )


def requeue(cfg: Config, conn: psycopg.Connection, user: User, *, ids: list[int] | None, reason: str | None) -> Done:
    """`reaper dead requeue --id ...` (all or none) or `--reason TEXT` / `--all` (chunks)."""
    db = cfg.database
    try:
        if ids is not None:
            r = dead_admin.requeue_ids(conn, db.schema, db.outbox_table, ids)
        else:
            r = dead_admin.requeue_matching(conn, db.schema, db.outbox_table, reason=reason)
    except AdminError as exc:
        _log(user, "dead-requeue", "refused", ids=ids, reason=reason, error=str(exc))
        return Done(False, str(exc))
    except psycopg.Error as exc:  # rows of chunks committed before it stay requeued
        _log(user, "dead-requeue", "failed", ids=ids, reason=reason, error=logs_safe(exc))
        raise
    _log(user, "dead-requeue", "done", ids=ids, reason=reason, moved=r.moved, dead_ids=r.dead_ids[:100])
    return Done(True, dead_admin.render_requeued(r))


def expire(cfg: Config, conn: psycopg.Connection, user: User, batch_id: int, note: str | None) -> Done:
    """`reaper batch expire ID --note NOTE`."""
    try:
        got = batch_admin.expire(cfg, conn, batch_id, note)
    except AdminError as exc:
        _log(user, "batch-expire", "refused", batch_id=batch_id, error=str(exc))
        return Done(False, str(exc))
    except psycopg.Error as exc:
        _log(user, "batch-expire", "failed", batch_id=batch_id, note=note, error=logs_safe(exc))
        raise
    _log(user, "batch-expire", "done", batch_id=batch_id, note=note, changed=got is not None)
    return Done(True, batch_admin.render_expired(batch_id, got))


async def requeue_acks(cfg: Config, db: Db, user: User, *, at: tuple[int, int] | None, reason: str | None) -> Done:
    """`reaper acks requeue --at P:O`, `--reason TEXT` or `--all`, holding a database connection
    only to check the admin log is there and then to record the requeue in it, never while Kafka
    is read or written (up to ~30 s): the console's small pool stays free for the pages. One audit
    line per requeue, whatever happens."""
    where = None if at is None else f"{at[0]}:{at[1]}"
    try:
        await db.run(lambda c: acks_admin.check(cfg, c))
        sent = await db.thread(lambda: acks_admin.send(cfg, at=at, reason=reason))
    except AdminError as exc:
        _log(user, "acks-requeue", "refused", at=where, reason=reason, error=str(exc))
        return Done(False, str(exc))
    r = sent.result
    letters = [f"{d.partition}:{d.offset}" for d in r.letters]
    try:
        await db.run(lambda c: acks_admin.record(cfg, c, sent))
    except Exception as exc:  # sent, but the database went away meanwhile: say so, in the audit line too
        error = logs_safe(exc)
        _log(user, "acks-requeue", "done", at=where, reason=reason, sent=r.requeued, dead_letters=letters, error=error)
        return Done(True, f"{acks_admin.render(r)}\nnot recorded in the admin log: {error}")
    _log(user, "acks-requeue", "done", at=where, reason=reason, sent=r.requeued, dead_letters=letters)
    return Done(True, acks_admin.render(r))
