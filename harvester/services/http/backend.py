"""The HTTP service's data access: a pool of autocommit psycopg AsyncConnections and one of two
backends with the same methods (http.backend):

- `TrackerStore` (default): the tracker's asyncio face, `tracker.aio.AsyncTracker`; each call is
  its own transaction (the connection is in autocommit, so the tracker opens and ends it).
- `SqlFunctionStore`: the SQL functions of sql/R__sql_api.sql, called as non-Python clients call them;
  RT SQLSTATEs come back as the tracker's own typed exceptions (sql_errors.py).

Every call answers within http.request_timeout (cutoff.py), on one of the connections its tenant
may use (token_connections.py); past the deadline it is StoreUnavailable (503), or TenantBusy (429)
when it was still waiting for one of its tenant's connections.
"""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Self, TypeVar

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from harvester.db_liveness import with_liveness
from harvester.db_pool import needs_new_connection
from harvester.services.http.cutoff import by_deadline
from harvester.services.http.sql_errors import tracker_error
from harvester.services.http.token_connections import TENANT, ConnectionsPerTenant
from tracker import Batch, BatchStatus, GroupHandle
from tracker.aio import AsyncTracker
from tracker.errors import (
    InvalidValue,
)
from tracker.metrics import DEFAULT_PREFIX
from tracker.schema import check_identifier

T = TypeVar("T")


@dataclass(frozen=True)
class OpenedBatch:
    id: int
    user_key: str | None
    completion_topic: str | None
    created_at: dt.datetime


@dataclass
class AckOutcome:
    acked: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)


@dataclass
class FailOutcome:
    failed: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)


FailurePage = tuple[list[tuple[str, str]], str | None]  # (item id, reason) rows and the next page's cursor


class StoreUnavailable(Exception):
    """The database could not be reached or did not answer in time. `maybe_applied`: the call had
    reached the database when it was cut off (at the deadline, or its connection lost), so its
    work may have committed; a write's audit line then says outcome unknown."""

    def __init__(self, message: str, maybe_applied: bool = False) -> None:
        super().__init__(message)
        self.maybe_applied = maybe_applied


class TenantBusy(StoreUnavailable):
    """The caller's tenant held its share of the pool for the whole time limit (429, not 503)."""

    def __init__(self, tenant: str, limit: int) -> None:
        super().__init__(
            f"tenant {tenant}'s requests already use its {limit} database connections (its share of the pool)"
        )
        self.tenant, self.limit = tenant, limit


def _statements(schema: str) -> dict[str, str]:
    s = sql.Identifier(check_identifier(schema, "schema"))
    q = {
        # now() is the transaction's start, which is the new row's created_at (its default)
        "open": "SELECT {s}.open_batch(%s, %s, %s, %s, %s), now()",
        "tenant": "UPDATE {batch} SET tenant = %s WHERE id = %s",
        # each batch's tenant (`default` for those opened without one, by the Python API or SQL) and state
        "owners": "SELECT id, coalesce(tenant, 'default'), state FROM {batch} WHERE id = ANY(%s)",
        "add": "SELECT batch_id, group_id, start, upto FROM {s}.add_items(%s, %s)",
        "close": "SELECT {s}.close_batch(%s, %s)",
        # claims => false: the request's transaction commits at once, and `completed` is reported
        "ack": "SELECT acked, duplicates, completed FROM {s}.ack(%s::text[], %s, claims => false)",
        "fail": "SELECT failed, duplicates, completed FROM {s}.fail(%s::text[], %s, %s)",
        "failures": "SELECT item_id, reason FROM {s}.failures(%s, %s, %s)",
        "status": "SELECT state, total, pending, user_key, created_at, closed_at, completed_at, last_activity_at, "
        "expired_at, outcome, failed, late, parent_id, children_open, children, children_failed FROM {s}.batch_status(%s)",
        "finished": "SELECT id FROM {batch} WHERE id = ANY(%s) AND state IN ('complete', 'expired')",
    }
    return {k: sql.SQL(v).format(s=s, batch=sql.Identifier(schema, "batch")).as_string(None) for k, v in q.items()}


async def _configure(conn: psycopg.AsyncConnection) -> None:
    """Behind a transaction pooler (PgBouncer), no named prepared statements (tracker/pooling.py):
    the pooler answers the startup's backend pid itself, so it differs from the real one."""
    cur = await conn.execute("SELECT pg_backend_pid()", prepare=False)
    row = await cur.fetchone()
    if row is not None and row[0] != conn.info.backend_pid:
        conn.prepare_threshold = None


class _PoolStore:
    def __init__(
        self,
        dsn: str,
        schema: str,
        *,
        completion_topic: str,
        pool_size: int,
        timeout: float,
        connections_per_tenant: int = 0,
    ) -> None:
        self.q = _statements(schema)
        self.per_tenant = ConnectionsPerTenant(connections_per_tenant)
        self.schema = schema
        self._bound: psycopg.AsyncConnection | None = None
        self.completion_topic = completion_topic
        self.timeout = timeout
        self.pool = AsyncConnectionPool(
            with_liveness(dsn),
            min_size=1,
            max_size=pool_size,
            open=False,
            timeout=timeout,
            kwargs={"autocommit": True},
            name="reaper-http",
            configure=_configure,
            # an idle connection whose server went away (a restart, a promotion) is replaced
            # before a request meets it, not reported to the client as a 503
            check=AsyncConnectionPool.check_connection,
        )

    async def open(self) -> None:
        await self.pool.open(wait=False)

    async def close(self) -> None:
        await self.pool.close()

    def bound(self, conn: psycopg.AsyncConnection) -> Self:
        """This store, running every call on `conn` (in the transaction the caller holds there)."""
        view = copy.copy(self)
        view._bound = conn
        return view

    async def within(self, call: Callable[[psycopg.AsyncConnection], Awaitable[T]]) -> T:
        """`call` on a connection, within the caller's share of the pool (token_connections.py) and
        the call's time limit (cutoff.py): past it, the connection is closed in the background, not
        reused. A store bound to a caller's connection runs within the caller's limit and share."""
        waiting = True  # for one of the caller's connections
        started = False  # on a connection: from here, a cut-off call's work may have committed

        async def work() -> T:
            nonlocal waiting, started
            async with self.per_tenant.hold():
                waiting = False
                async with self.pool.connection() as conn:
                    started = True
                    try:
                        return await call(conn)
                    except asyncio.CancelledError:
                        await conn.close()  # cut off mid-call: its state is unknown, the pool discards it
                        raise
                    except psycopg.Error as exc:
                        if needs_new_connection(exc):
                            await conn.close()  # the pool discards it: a multi-host DSN then finds the primary
                        raise

        if self._bound is not None:
            return await call(self._bound)
        try:
            return await by_deadline(work(), self.timeout)
        except (TimeoutError, PoolTimeout) as exc:
            tenant = TENANT.get()
            if waiting and tenant is not None:
                raise TenantBusy(tenant, self.per_tenant.limit) from None
            raise StoreUnavailable("the database did not answer in time", maybe_applied=started) from exc
        except psycopg.OperationalError as exc:
            # The connection broke mid-call (no SQLSTATE, or class 08): a commit may have gone
            # through unanswered. An error the server answered rolled the call back.
            if started and (exc.sqlstate is None or exc.sqlstate.startswith("08")):
                raise StoreUnavailable(type(exc).__name__, maybe_applied=True) from None
            raise

    async def _sql(self, call: Callable[[psycopg.AsyncConnection], Awaitable[T]]) -> T:
        """`call` within the time limit; database errors as the tracker's typed ones."""
        try:
            return await self.within(call)
        except psycopg.Error as exc:
            err = tracker_error(exc)
            if err is not None:
                raise err from None
            if isinstance(exc, (psycopg.OperationalError, psycopg.errors.QueryCanceled)):
                raise StoreUnavailable(type(exc).__name__) from None
            if isinstance(exc, psycopg.DataError):  # e.g. a NUL, which PostgreSQL text cannot hold
                raise InvalidValue("request", "(a value of the request)", str(exc).splitlines()[0]) from None
            raise

    async def _fetch(self, query: str, params: list) -> list[tuple]:
        async def rows(conn: psycopg.AsyncConnection) -> list[tuple]:
            cur = await conn.execute(query, params)
            return await cur.fetchall()

        return await self._sql(rows)

    async def ping(self) -> None:
        await self._fetch("SELECT 1", [])

    async def owners(self, batch_ids: list[int]) -> dict[int, tuple[str, str]]:
        """batch id -> (its tenant, its state), for those of these batches that exist."""
        return {r[0]: (r[1], r[2]) for r in await self._fetch(self.q["owners"], [batch_ids])}

    async def finished(self, batch_ids: list[int]) -> set[int]:
        """Which of these batches are complete or expired (one query for every long-poll waiter)."""
        return {r[0] for r in await self._fetch(self.q["finished"], [batch_ids])}


class TrackerStore(_PoolStore):
    """The tracker's asyncio face on pooled autocommit connections."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        *,
        completion_topic: str,
        pool_size: int,
        timeout: float,
        metrics_prefix: str = DEFAULT_PREFIX,
        connections_per_tenant: int = 0,
    ) -> None:
        super().__init__(
            dsn,
            schema,
            completion_topic=completion_topic,
            pool_size=pool_size,
            timeout=timeout,
            connections_per_tenant=connections_per_tenant,
        )
        # the tracker calls count under the service's prefix (metrics.prefix), like its HTTP metrics
        self.tracker = AsyncTracker(schema=schema, completion_topic=completion_topic, metrics_prefix=metrics_prefix)

    async def _call(self, call: Callable[[psycopg.AsyncConnection], Awaitable[T]]) -> T:
        try:
            return await self.within(call)
        except (psycopg.OperationalError, psycopg.errors.QueryCanceled) as exc:
            raise StoreUnavailable(type(exc).__name__) from None

    async def open_batch(
        self,
        user_key: str | None,
        completion_topic: str | None,
        tenant: str | None,
        *,
        parent: int | None = None,
        tolerated_failures: int | None = None,
        tolerated_failure_ratio: float | None = None,
    ) -> OpenedBatch:
        t = self.tracker

        async def open_for(c: psycopg.AsyncConnection) -> Batch:
            async with c.transaction():  # the batch and its tenant together (a savepoint when bound)
                b = await t.open_batch(
                    c,
                    user_key=user_key,
                    completion_topic=completion_topic,
                    parent=parent,
                    tolerated_failures=tolerated_failures,
                    tolerated_failure_ratio=tolerated_failure_ratio,
                )
                if tenant is not None:
                    await c.execute(self.q["tenant"], [tenant, b.id])
                return b

        b = await self._call(open_for)
        assert b.created_at is not None  # open_batch returns the new row's created_at (NOT NULL)
        return OpenedBatch(b.id, b.user_key, b.completion_topic, b.created_at)

    async def add_items(self, batch_id: int, n: int) -> list[GroupHandle]:
        return await self._call(lambda c: self.tracker.add_items(c, batch_id, n))

    async def close_batch(self, batch_id: int) -> bool:
        return await self._call(lambda c: self.tracker.close_batch(c, batch_id))

    async def ack(self, ids: list[str]) -> AckOutcome:
        if not ids:
            return AckOutcome()
        # The server's own short transaction: the masked path reports `completed` exactly (claims
        # would settle at commit and report nothing), and its batch locks last only this request.
        r = await self._call(lambda c: self.tracker.ack(c, ids, claims=False))
        return AckOutcome(r.acked, r.duplicates, list(r.completed))

    async def fail(self, ids: list[str], reason: str) -> FailOutcome:
        if not ids:
            return FailOutcome()
        # the server's own short transaction, as an ack's: the named batches stay locked only for it
        r = await self._call(lambda c: self.tracker.fail(c, ids, reason))
        return FailOutcome(r.failed, r.duplicates, list(r.completed))

    async def failures(self, batch_id: int, after: str | None, limit: int) -> FailurePage:
        page = await self._call(lambda c: self.tracker.failures(c, batch_id, after=after, limit=limit))
        return list(page.items), page.next

    async def status(self, batch_id: int) -> BatchStatus:
        return await self._call(lambda c: self.tracker.status(c, batch_id))


class SqlFunctionStore(_PoolStore):
    """The SQL functions of sql/R__sql_api.sql, as any other language calls them."""

    async def open_batch(
        self,
        user_key: str | None,
        completion_topic: str | None,
        tenant: str | None,
        *,
        parent: int | None = None,
        tolerated_failures: int | None = None,
        tolerated_failure_ratio: float | None = None,
    ) -> OpenedBatch:
        ratio = None if tolerated_failure_ratio is None else float(tolerated_failure_ratio)
        args = [user_key, completion_topic, parent, tolerated_failures, ratio]
        if tenant is None:
            ((batch_id, created_at),) = await self._fetch(self.q["open"], args)
            return OpenedBatch(batch_id, user_key, completion_topic, created_at)

        async def open_for(conn: psycopg.AsyncConnection) -> tuple:
            async with conn.transaction():
                # the batch and its tenant together (a savepoint when bound to a caller's transaction)
                cur = await conn.execute(self.q["open"], args)
                row = await cur.fetchone()
                assert row is not None
                await conn.execute(self.q["tenant"], [tenant, row[0]])
                return row

        row = await self._sql(open_for)
        return OpenedBatch(row[0], user_key, completion_topic, row[1])

    async def add_items(self, batch_id: int, n: int) -> list[GroupHandle]:
        rows = await self._fetch(self.q["add"], [batch_id, n])
        return [GroupHandle(b, g, upto, start) for b, g, start, upto in rows]

    async def close_batch(self, batch_id: int) -> bool:
        ((complete,),) = await self._fetch(self.q["close"], [batch_id, self.completion_topic])
        return bool(complete)

    async def ack(self, ids: list[str]) -> AckOutcome:
        rows = await self._fetch(self.q["ack"], [ids, self.completion_topic])
        acked, duplicates, completed = rows[0]
        return AckOutcome(acked, duplicates, list(completed))

    async def fail(self, ids: list[str], reason: str) -> FailOutcome:
        rows = await self._fetch(self.q["fail"], [ids, reason, self.completion_topic])
        failed, duplicates, completed = rows[0]
        return FailOutcome(failed, duplicates, list(completed))

    async def failures(self, batch_id: int, after: str | None, limit: int) -> FailurePage:
        items = [(i, r) for i, r in await self._fetch(self.q["failures"], [batch_id, after, limit])]
        return items, (items[-1][0] if len(items) == limit else None)

    async def status(self, batch_id: int) -> BatchStatus:
        rows = await self._fetch(self.q["status"], [batch_id])
        return BatchStatus(*rows[0])


Store = TrackerStore | SqlFunctionStore
