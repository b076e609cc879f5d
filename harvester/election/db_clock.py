"""This process's monotonic clock mapped onto the database server's clock.

A leadership lease (harvester.election.neli) ends at a monotonic time of this process. The server can only
compare against its own clock, so the marker maps the lease's end through an anchor: the server's
time read by one query, paired with this process's monotonic time after the reply. The server's
reading was taken before that, so a deadline mapped through it lands early by at most one round
trip, never late, and no synchronisation between the hosts' clocks is assumed.

The anchor is re-read every CLOCK_ANCHOR_MAX_AGE, and forgotten after any error (the server may
have failed over to a host whose clock differs). Arithmetic is in UTC: a server whose TimeZone has
daylight saving returns zoned times, and adding seconds to those in local time is off by the
shift across a change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

# One cheap query a second. Clocks drift apart by at most ~500 ppm (NTP's slew limit), 0.5 ms over
# this; a step of the server's clock forward (marks refused as late) is corrected within it.
CLOCK_ANCHOR_MAX_AGE = 1.0


class DatabaseClock:
    def __init__(self, read_now: Callable[[], datetime], max_age: float = CLOCK_ANCHOR_MAX_AGE) -> None:
        self._read_now = read_now
        self.max_age = max_age
        self._anchor: tuple[datetime, float] | None = None
        self.generation = 0  # bumped with every new anchor: what was mapped through the old one is stale

    def refresh(self) -> None:
        server = self._read_now().astimezone(UTC)
        self._anchor = (server, time.monotonic())
        self.generation += 1

    def forget(self) -> None:
        """Re-read the server's clock before the next mapping."""
        self._anchor = None

    def at(self, monotonic_t: float) -> datetime:
        """The server's time (UTC) at monotonic time `monotonic_t`, re-anchored when the anchor is old."""
        if self._anchor is None or time.monotonic() - self._anchor[1] > self.max_age:
            self.refresh()
        assert self._anchor is not None
        server, local = self._anchor
        return server + timedelta(seconds=monotonic_t - local)
