"""Settling: fold consumers' committed ack claims into bits, counts and completion.

Most claims are settled by their own transaction's commit (sql/R__ack_claims.sql). A commit
that finds the batch row busy (another settle, the acker, an add or a close in progress), or
that runs under REPEATABLE READ / SERIALIZABLE, leaves its claims committed as they are; they
wait for the next settle of that batch. A child that finishes
leaves a row for its parent (it never locks the parent's row), folded in by the parent's next
close, ack, failure or settle, or the reaper's next sweep (tracker.expiry): `settle()` with no
ids also settles those parents. An application running no reaper calls it periodically.
`settle()` is that next settle, on demand; the reaper's claim settler
(harvester.services.claim_settler) runs it in a loop (every `interval` seconds, in short transactions of its own that
never wait for a lock), which bounds how long a completion can lag the commit of the batch's last
ack. A close settles its batch too.

Every settle runs `ack_settle` under the batch row lock, like every other writer of a batch's
groups, so the completion decision stays in exactly one transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog
from prometheus_client import REGISTRY, CollectorRegistry
from psycopg import sql

from tracker import metrics
from tracker.config import DEFAULT_COMPLETION_TOPIC, DEFAULT_OUTBOX_TABLE, DEFAULT_SCHEMA, TrackerConfig
from tracker.core.batches import render
from tracker.core.steps import Op, Query, Round
from tracker.drivers import sync_psycopg as driver
from tracker.drivers.connections import SyncSession, sync_connection
from tracker.errors import InvalidArgument, InvalidValue
from tracker.folding import ID_MAX

log = structlog.get_logger("reaper.settler")

MAX_DEPTH = 7  # the deepest a batch nests (sql/0016_outcomes.sql: batch.depth)


@dataclass
class SettleResult:
    acked: int = 0  # bits the settles cleared
    completed: list[int] = field(default_factory=list)  # batches they completed
    busy: list[int] = field(default_factory=list)  # batches whose row was locked elsewhere


@functools.lru_cache(maxsize=64)
def statements(schema: str, outbox_table: str) -> dict[str, str]:
    q = {
        # Committed claims only (READ COMMITTED): in-flight ones settle at their own commit. And
        # parents of committed finished children not folded in yet (sql/R__outcomes.sql).
        "claimed": sql.SQL(
            "SELECT batch_id FROM (SELECT batch_id FROM {claim} UNION SELECT parent_id FROM {child}) AS s "
            "ORDER BY batch_id LIMIT %s"
        ),
        # wait=false: up to `limit` batches whose row is free (locked here; ack_settle then locks
        # it again), so busy ones at the head of the ids never starve the rest; with them, up to
        # `limit` of the others before the last free one (held elsewhere: reported busy, or deleted:
        # their claims dropped), as a settle of every id from the head would have met them.
        "claimed_free": sql.SQL(
            "WITH s AS (SELECT batch_id AS id FROM {claim} UNION SELECT parent_id FROM {child}), "
            "free AS (SELECT b.id FROM {batch} b WHERE b.id IN (SELECT id FROM s) "
            "ORDER BY b.id LIMIT %(n)s FOR NO KEY UPDATE SKIP LOCKED), "
            "rest AS (SELECT s.id FROM s WHERE s.id NOT IN (SELECT id FROM free) "
            "AND (s.id < (SELECT max(id) FROM free) OR (SELECT count(*) FROM free) < %(n)s) ORDER BY s.id LIMIT %(n)s) "
            "SELECT id FROM free UNION ALL SELECT id FROM rest ORDER BY 1"
        ),
        # In batch-id order: with wait=true, two settles lock their batches in the same order.
        "settle": sql.SQL(
            "SELECT u.b, s.flipped, s.completed FROM unnest(%s::int8[]) WITH ORDINALITY AS u(b, n),"
            " LATERAL {settle}(u.b, {outbox}::regclass, %s, %s) AS s ORDER BY u.n"
        ),
    }
    return render(schema, outbox_table, q, claim="ack_claim", child="child_finished", settle="ack_settle")


def settle_op(
    q: dict[str, str], batch_ids: list[int] | None, completion_topic: str, wait: bool, limit: int
) -> Op[SettleResult]:
    result = SettleResult()
    named = batch_ids is not None
    # Without ids: a batch finished by one pass leaves a row for its parent, settled by the next
    # pass of the same call (one level per pass; batches nest at most MAX_DEPTH + 1 deep).
    for _pass in range(1 if named else MAX_DEPTH + 1):
        if not named:
            pick = Query(q["claimed"], [limit], "all") if wait else Query(q["claimed_free"], {"n": limit}, "all")
            (rows,) = yield Round((pick,))
            batch_ids = [b for (b,) in rows]
        if not batch_ids:
            return result
        (rows,) = yield Round((Query(q["settle"], [batch_ids, completion_topic, wait], "all"),))
        finished = False
        for b, flipped, completed in rows:
            if flipped is None:
                if b not in result.busy:
                    result.busy.append(b)
                continue
            result.acked += flipped
            if completed:
                result.completed.append(b)
                finished = True
        if not finished:
            break
    return result


def settle(
    session: SyncSession,
    batch_ids: Iterable[int] | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    outbox_table: str = DEFAULT_OUTBOX_TABLE,
    completion_topic: str = DEFAULT_COMPLETION_TOPIC,
    wait: bool = False,
    limit: int = 1000,
    registry: CollectorRegistry | None = REGISTRY,
    metrics_prefix: str = metrics.DEFAULT_PREFIX,
) -> SettleResult:
    """Settle committed claims of `batch_ids` (default: of up to `limit` batches that have any) in
    the caller's transaction. wait=False skips a batch whose row another transaction holds (a named
    one comes back in `busy`; without ids, the pick passes over held rows to the next batches with
    claims); wait=True waits for it. Completion events go to `outbox_table`, on the
    batch's own completion topic or else `completion_topic`. Completions are counted in
    `<metrics_prefix>_batches_completed_total` of `registry` (None: not counted)."""
    config = TrackerConfig(schema, outbox_table, completion_topic)
    if not isinstance(limit, int) or isinstance(limit, bool):
        raise InvalidArgument("limit", limit, "an int")
    if not 1 <= limit <= ID_MAX:  # a Postgres bigint
        raise InvalidValue("limit", limit, f"must be between 1 and {ID_MAX}")
    ids: list[int] | None = None
    if batch_ids is not None:
        if isinstance(batch_ids, (str, bytes, bytearray, memoryview, dict)) or not isinstance(batch_ids, Iterable):
            raise InvalidArgument("batch_ids", batch_ids, "an iterable of batch ids (ints >= 0) or None")
        given = list(batch_ids)
        for b in given:
            if not isinstance(b, int) or isinstance(b, bool):
                raise InvalidArgument("batch_ids", b, "batch ids (ints >= 0)")
            if not 0 <= b <= ID_MAX:
                raise InvalidValue("batch_ids", b, f"a batch id is between 0 and {ID_MAX}")
        ids = sorted(set(given))
    q = statements(config.schema, config.outbox_table)
    result = driver.run(sync_connection(session), settle_op(q, ids, config.completion_topic, wait, limit))
    if registry is not None and result.completed:
        metrics.for_registry(registry, metrics_prefix).batches_completed.labels(config.schema).inc(
            len(result.completed)
        )
    return result
