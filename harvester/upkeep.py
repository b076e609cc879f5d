"""A harvest unit's upkeep of its outbox table, beside marking and publishing: the leader's vacuum,
and (lanes > 1) the lane index (harvester.lane_index). Each on a daemon thread of its own, doing
nothing while this process does not lead the unit."""

from __future__ import annotations

import threading
from collections.abc import Callable

from structlog.typing import FilteringBoundLogger

from .config import HarvesterConfig, UnitSpec
from .lane_index import LaneIndex, LaneIndexKeeper
from .ports import StoreLike
from .publish import logs_safe
from .store import OutboxStore


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
    ) -> None:
        """`store` is what the vacuum goes through (wrapped by the providers), `outbox` the store whose
        mark the lane index switches; `purged_rows` counts the rows the unit has deleted so far."""
        self.h, self.spec, self.store = h, spec, store
        self._purged_rows, self._leading, self._stop, self._log = purged_rows, leading, stop, log
        self.vacuums = 0
        self.lane_index: LaneIndexKeeper | None = None
        if spec.lanes > 1 and h.lane_index:
            index = LaneIndex(spec.schema, spec.table, spec.lanes)
            self.lane_index = LaneIndexKeeper(index, spec.dsn, spec.lane == 0, outbox.use_lane_index, log)
        self._vacuum: threading.Thread | None = None

    def start(self) -> None:
        # One VACUUM of a table at a time is enough (a second would wait for it): lane 0's leader's.
        if self.h.vacuum_interval > 0 and self.spec.lane == 0:
            self._vacuum = threading.Thread(target=self._vacuum_loop, name="reaper-upkeep", daemon=True)
            self._vacuum.start()
        if self.lane_index is not None:
            threading.Thread(
                target=self.lane_index.run, args=(self._stop, self._leading), name="reaper-lane-index", daemon=True
            ).start()

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

    def _vacuum_loop(self) -> None:
        """The leader vacuums the outbox every vacuum_interval while it is deleting rows."""
        last_purged = self._purged_rows()
        while not self._stop.wait(self.h.vacuum_interval):
            if not self._leading():
                continue
            purged = self._purged_rows()
            if purged == last_purged:
                continue
            last_purged = purged
            try:
                self.store.vacuum()
                self.vacuums += 1
            except Exception as exc:
                self._log.warning("vacuum failed", error=logs_safe(exc))
