"""A harvest unit's upkeep of its outbox table, beside marking and publishing: the leader's vacuum,
(lanes > 1) the lane index (harvester.lane_index), and, once per process, dropping the lane
indexes a configuration with another lane count left behind. Each on a daemon thread of its own,
doing nothing while this process does not lead the unit."""

from __future__ import annotations

import threading
from collections.abc import Callable

import psycopg
from structlog.typing import FilteringBoundLogger

from harvester import logs
from harvester.config import HarvesterConfig, UnitSpec
from harvester.db_liveness import with_liveness
from harvester.lane_index import LaneIndex, LaneIndexKeeper, NotHeld, retire_lane_indexes
from harvester.publishing.outbox_sql import OutboxStore
from harvester.publishing.ownership import OutboxClaim
from harvester.publishing.ports import StoreLike
from harvester.publishing.publisher import logs_safe

RETIRE_BACKOFF_MAX = 900.0  # seconds: retries of a lane index drop that keeps failing, from 30 s doubling


class Upkeep:
    def __init__(
        self,
        h: HarvesterConfig,
        spec: UnitSpec,
        store: StoreLike,
        outbox: OutboxStore,
        purged_rows: Callable[[], int],
        leading: Callable[[], bool],
        stop: threading.Event,
        log: FilteringBoundLogger,
        claim: OutboxClaim,
    ) -> None:
        """`store` is what the vacuum goes through (wrapped by the providers), `outbox` the store whose
        mark the lane index switches; `purged_rows` counts the rows the unit has deleted so far;
        `claim` is the unit's hold of the table (harvester.publishing.ownership)."""
        self.h, self.spec, self.store, self._outbox = h, spec, store, outbox
        self._purged_rows, self._leading, self._stop, self._log = purged_rows, leading, stop, log
        self.claim = claim
        self.vacuums = 0  # that ran (Postgres skips a locked table: SKIP_LOCKED)
        self.lane_index: LaneIndexKeeper | None = None
        if spec.lanes > 1 and h.lane_index:
            index = LaneIndex(spec.schema, spec.table, spec.lanes)
            self.lane_index = LaneIndexKeeper(index, spec.dsn, spec.lane == 0, outbox.use_lane_index, log)
            self.lane_index.may_build = lambda: claim.holding  # a configuration kept from the table builds nothing
        self.retired: list[str] | None = None  # the lane indexes dropped, once that was done
        self._retire_failures = 0
        self._vacuum: threading.Thread | None = None

    def start(self) -> None:
        # One VACUUM of a table at a time is enough (a second would wait for it): lane 0's leader's.
        if self.h.vacuum_interval > 0 and self.spec.lane == 0:
            self._vacuum = logs.unit_thread(self._vacuum_loop, "reaper-upkeep")
            self._vacuum.start()
        if self.lane_index is not None:
            logs.unit_thread(self.lane_index.run, "reaper-lane-index", (self._stop, self._leading)).start()
        if self.spec.lane == 0:
            logs.unit_thread(self._retire_loop, "reaper-lane-retire").start()

    def join(self, timeout: float) -> None:
        """After `stop` is set. A lane index build in progress is not waited for (a daemon thread:
        if the process exits, Postgres cancels the build, and the next leader drops what it left)."""
        if self._vacuum is not None:
            self._vacuum.join(timeout)

    def mark_trouble(self) -> None:
        """A mark failed, was refused or was slow: if it went through the lane index, the index may
        be gone (each mark through a dropped one scans the whole table), so have it checked now."""
        if self.lane_index is not None and self.lane_index.valid:
            self.lane_index.recheck_soon()

    def _deletions(self) -> tuple[int, int | None]:
        """What has been deleted from the table so far: by this unit (at once) and by anyone (the
        table's statistics: other lanes, led here or by other processes, purge it too)."""
        try:
            table = self._outbox.deleted_rows()
        except Exception as exc:  # the vacuum itself then says what is wrong, if anything
            self._log.debug("the outbox's deletions could not be read", error=logs_safe(exc))
            table = None
        return self._purged_rows(), table

    def _vacuum_loop(self) -> None:
        """Lane 0's leader vacuums the outbox every vacuum_interval while rows are deleted from it,
        by any lane."""
        last, skipped_in_a_row = self._deletions(), 0
        while not self._stop.wait(self.h.vacuum_interval):
            if not self._leading():
                continue
            now = self._deletions()
            if now == last:
                continue
            last = now
            try:
                ran = self.store.vacuum()
            except Exception as exc:
                self._log.warning("vacuum failed", error=logs_safe(exc))
                continue
            if ran:
                self.vacuums += 1
                if skipped_in_a_row:
                    self._log.info("vacuum runs again", skipped=skipped_in_a_row)
                skipped_in_a_row = 0
            else:
                skipped_in_a_row += 1
                if skipped_in_a_row == 1:  # once per stretch: it retries every vacuum_interval
                    self._log.info("vacuum skipped: another session holds the table (a lane index build or drop, DDL)")

    def _retire_loop(self) -> None:
        """Once this process leads lane 0, its configuration holds the table (no other marks it any
        more) and the lane index it uses is valid (its build and these drops would deadlock), drop
        the lane indexes it does not use: left by a lane count it replaced, or unwanted since
        harvester.lane_index was turned off. Their upkeep slows every insert."""
        wait = 1.0
        while not self._stop.wait(wait):
            wait = 1.0
            keeper = self.lane_index
            if not (self._leading() and self.claim.holding and (keeper is None or keeper.valid)):
                continue
            try:
                with psycopg.connect(with_liveness(self.spec.dsn), autocommit=True) as conn:
                    keep = keeper.index.name if keeper is not None else None  # the one this configuration uses
                    retired = retire_lane_indexes(conn, self.spec.schema, self.spec.table, keep, self.claim.held_now)
            except NotHeld:
                continue  # the next leadership (or hold) tries again
            except psycopg.errors.InsufficientPrivilege as exc:
                self._log.warning(
                    "lane indexes of another lane count are left in place: this role may not drop them",
                    error=logs_safe(exc),
                    hint="the table's owner can drop the indexes commented 'outbox-reaper lane index'",
                )
                return
            except psycopg.Error as exc:  # cancelled after RETIRE_WAIT behind other sessions' locks, say
                self._retire_failures += 1
                wait = min(RETIRE_BACKOFF_MAX, 30.0 * 2 ** (self._retire_failures - 1))
                self._log.warning("dropping unused lane indexes failed", error=logs_safe(exc), retry_in_s=wait)
                continue
            self.retired = retired
            for name in retired:
                self._log.info("dropped a lane index this configuration does not use", index=name)
            return
