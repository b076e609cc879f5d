"""The acker's Postgres side: a fold's steps applied in one transaction (step 3 of the acker's loop,
harvester.services.acker).

`tracker.Tracker.apply_outcomes` applies every step, acks and each reason's failures, with
reject_invalid=True and skip_locked=True: unknown batches/groups, out-of-range indexes and expired
batches come back as rejected, and a batch whose row another transaction holds is not waited for
but comes back skipped, its masks in that step and every later one kept in order for the acker to
defer. The transaction bounds any other wait by `lock_timeout` and commits durably whatever the
role says, since the acker commits its Kafka offsets only after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import psycopg

from harvester.db_liveness import with_liveness
from harvester.db_pool import needs_new_connection
from harvester.services.ack_steps import Step
from tracker.pooling import configure_for_pooler
from tracker.sync import Tracker


@dataclass
class Applied:
    """What one apply of a list of steps did."""

    acked: int = 0
    failed: int = 0
    duplicates: int = 0
    completed: list[int] = field(default_factory=list)
    rejected: list[tuple[str, str, str | None]] = field(default_factory=list)  # entry, why, failure reason
    skipped: list[Step] = field(default_factory=list)  # steps of batches held elsewhere, in order


class StepApplier:
    """Applies steps to one schema's batch tables (its tracker's), on a connection of its own that
    it opens on first use and again after one is lost or reaches a server that cannot write."""

    def __init__(self, *, dsn: str, tracker: Tracker, lock_timeout: float) -> None:
        self.dsn = dsn
        self.tracker = tracker
        self.lock_timeout = lock_timeout  # seconds
        self.conn: psycopg.Connection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

    def apply(self, steps: list[Step]) -> Applied:
        """Apply the steps in order, in one transaction. A batch another transaction holds is not
        waited for: its masks in that step and every later one come back in `skipped`, in order."""
        if not any(masks for _r, masks in steps):
            return Applied()
        conn = self.conn
        if conn is None or conn.closed or conn.broken:
            conn = self.conn = psycopg.connect(with_liveness(self.dsn), autocommit=True)
            configure_for_pooler(conn)  # PgBouncer in transaction mode: no prepared statements
        out = Applied()
        try:
            with conn.transaction():  # every step in one transaction: all of the poll or none
                # Set for this transaction only (a transaction pooler hands the session to others):
                # a bound on any wait SKIP LOCKED does not cover (the poll is then retried), and a
                # commit that waits for the WAL flush whatever the role says, since the offsets are
                # committed to Kafka after it and acks lost in a crash would never come again.
                conn.execute(
                    "SELECT set_config('lock_timeout', %s, true), set_config('synchronous_commit', 'on', true)",
                    [f"{int(self.lock_timeout * 1000)}ms"],
                )
                # every batch locked at once, one statement a step, sent together: a batch held
                # elsewhere is skipped in every step, its masks kept in their order
                results = self.tracker.apply_outcomes(conn, steps, reject_invalid=True, skip_locked=True)
        except psycopg.Error as exc:
            if needs_new_connection(exc):
                conn.close()  # a read-only or departing server: the DSN picks the primary anew
            if conn.broken or conn.closed:
                self.conn = None
            raise
        for (reason, _masks), result in zip(steps, results):
            if reason is None:
                out.acked += result.acked
            else:
                out.failed += result.acked
            out.duplicates += result.duplicates
            out.completed.extend(result.completed)
            out.rejected.extend((entry, why, reason) for entry, why in result.rejected)
            if result.skipped:
                out.skipped.append((reason, result.skipped))
        return out
