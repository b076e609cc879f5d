"""The harvester of one reaper process: one NELI lease and one UnitHarvester per harvest unit.

Units come from the configuration (harvester.config.units): each outbox table, or each lane of
one. The leader topic has one partition per unit; Kafka's group assignment (cooperative-sticky)
spreads the partitions, hence the units, over the reapers of the group, and holding partition u
means leading unit u. Every unit has its own heartbeat, fence, leader id, pool, producer and (with
harvester.transactional_id) transactional id `<transactional_id>.<unit name>` (the plain id when
there is one unit), so a new leader of unit u fences only unit u's previous leader.

Lanes: a row belongs to lane md5(key) mod lanes (harvester.publishing.outbox_sql.lane_of), so every row of a key
is harvested by one unit and keeps its order. Changing the lane count would move keys between
lanes, so it is done by draining, then switching: stop every reaper of the old configuration, then
start the new one with a new leader topic and group (a leader topic whose partition count
disagrees with the configured units is refused at start). In between, no unit harvests; after it,
each new lane marks its keys from the head of the table, in id order. No key is ever harvested
by two units at once: at any time one configuration runs, and within it a key has one lane.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from harvester import logs
from harvester.config import Config, UnitSpec, units
from harvester.db_pool import probe_writable
from harvester.election.neli import Neli
from harvester.election.step_down import StepDown
from harvester.metrics import HarvesterMetrics, UnitMetrics
from harvester.metrics import get as get_metrics
from harvester.publishing.mark_purge_reset import UnitHarvester
from harvester.publishing.ports import DEFAULT, Providers
from harvester.publishing.publisher import Lifecycle, Publisher, logs_safe


def transactional_id(base: str, spec: UnitSpec, count: int) -> str:
    if not base:
        return ""
    return base if count == 1 else f"{base}.{spec.name}"


class Harvester:
    def __init__(
        self,
        cfg: Config,
        *,
        providers: Providers = DEFAULT,
        metrics: HarvesterMetrics | None = None,
    ) -> None:
        self.cfg, self.h = cfg, cfg.harvester
        self.providers = providers
        self.m = metrics or get_metrics(cfg.metrics.prefix)
        self.specs = units(cfg)
        self._life = Lifecycle("harvester")
        self._log = logs.get("reaper.harvester")
        self._unit_metrics = [UnitMetrics(self.m, s.name) for s in self.specs]
        self.units = [
            UnitHarvester(
                cfg,
                s,
                providers=providers,
                metrics=self._unit_metrics[s.index],
                transactional_id=transactional_id(self.h.transactional_id, s, len(self.specs)),
            )
            for s in self.specs
        ]
        self.neli: Neli | None = None

    def start(self) -> Harvester:
        """Start once; a stopped harvester cannot be started again (LifecycleError)."""
        self._life.start()
        cfg, h = self.cfg, self.h
        self.neli = Neli(
            bootstrap=cfg.kafka.bootstrap_servers,
            client=cfg.kafka.client,
            consumer=cfg.kafka.consumer,
            producer=cfg.kafka.producer,
            topic=h.leader_topic,
            group=h.leader_group,
            min_poll_interval=h.min_poll_interval,
            heartbeat_timeout=h.heartbeat_timeout,
            resume_steady=h.resume_steady,
            session_timeout=h.session_timeout,
            metrics=lambda u: self._unit_metrics[u],
            units=len(self.units),
            make_producer=self.providers.heartbeat_producer,
            step_down=StepDown(h.step_down_after, self._probe, self.m.step_downs),
        )
        try:
            cluster = self.neli.prepare()  # the leader topic agrees with the units before any starts
            for u in self.units:
                u.start(self.neli.lease(u.spec.index), kafka_cluster=cluster)
            self.neli.start()
        except BaseException:
            self._life.stop()
            # What failed is what the caller sees: the clean-up closes what started, and a failure
            # of its own is logged, never raised in place of the original.
            self._close_units(0.1)
            raise
        return self

    def _probe(self, unit: int, timeout: float) -> None:
        """Raises unless unit's database answers through its pool and takes writes (see StepDown)."""
        pool = self.units[unit].pool
        assert pool is not None  # started before the election
        probe_writable(pool, timeout)

    def stop(self, drain_timeout: float | None = None, *, hurry: threading.Event | None = None) -> bool:
        """Stop marking everywhere, let in-flight records settle (up to drain_timeout in all; once
        `hurry` is set, no longer), leave the group, close. False when records were still in flight
        at the deadline or when `hurry` cut the wait short."""
        if not self._life.stop():
            return True
        return self._close_units(self.h.drain_timeout if drain_timeout is None else drain_timeout, hurry)

    def _close_units(self, timeout: float, hurry: threading.Event | None = None) -> bool:
        """Stop, drain and close every unit and the election, whatever each got to in start(): a
        step that fails is logged (and counts as not drained) and the others still run."""
        for u in self.units:
            u.begin_stop()
        deadline = time.monotonic() + timeout
        drained = True
        for u in self.units:
            left = max(0.1, deadline - time.monotonic())
            drained &= self._quietly(f"draining unit {u.spec.name}", u.finish, left, hurry) is True
        if self.neli is not None:  # leaves the group: every unit's partition moves to a standby at once
            self._quietly("leaving the leader group", self.neli.stop)
        for u in self.units:
            self._quietly(f"closing unit {u.spec.name}", u.close)
        return drained

    def _quietly(self, what: str, step: Callable[..., object], *args: object) -> object:
        """`step(*args)`, or None (logged) if it raised."""
        try:
            return step(*args)
        except Exception as exc:
            self._log.error("harvester stop step failed", step=what, error=logs_safe(exc))
            return None

    # ------------------------------------------------------------------ views

    @property
    def error(self) -> BaseException | None:
        """What stopped a unit, or the election (then no unit leads again), if anything did."""
        if self.neli is not None and self.neli.error is not None:
            return self.neli.error
        return next((u.error for u in self.units if u.error is not None), None)

    def leading_units(self) -> list[str]:
        return [u.spec.name for u in self.units if u.leading]

    # One-unit deployments and tests read the first unit through these.
    @property
    def unit(self) -> UnitHarvester:
        return self.units[0]

    @property
    def publisher(self) -> Publisher | None:
        return self.units[0].publisher

    @property
    def store(self):
        return self.units[0].store

    @property
    def leading(self) -> bool:
        return self.units[0].leading

    @property
    def current_id(self) -> uuid.UUID | None:
        return self.units[0].current_id

    @property
    def remark_backoff(self) -> float:
        return self.units[0].remark_backoff

    @property
    def vacuums(self) -> int:
        return self.units[0].vacuums

    def force_remark(self, why: str) -> None:
        for u in self.units:
            u.force_remark(why)
