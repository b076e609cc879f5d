"""When a fenced leader may lead again: once its heartbeats have come back steadily for a while.

A fence is cheap to enter and dear to leave. Each resumption takes a new leader id, which marks
from the head of the outbox and republishes everything in flight; each fence retires the data
producer, purging what it had in flight (harvester.publishing.producer_slot). A leader that
resumed at the first heartbeat back flapped when the heartbeat path did: a heartbeat queued in
the producer while the leader topic's partition failed over, acknowledged late, vouched for a
lease with a fraction of a second left, the next one was late again, and the leader fenced again
(a broker kill under load: four fences in eight seconds, each resending the records in flight).

So a fenced lease resumes only once its own heartbeats have come back steadily: at every election
pulse the newest one back was sent at most FRESH x `heartbeat_timeout` ago, and those sent over
`resume_steady` seconds came back so, without a break. The run is measured on the heartbeats' send
times, not on the clock: the validity left by the last heartbeat of a brief reopening (up to
`heartbeat_timeout` after it was sent) proves nothing about the path after it. A leader that fences again within one session timeout of resuming waits twice as long the
next time, up to MAX_STEADY_FACTOR times `resume_steady`; a calm leadership resets it. Fencing is
untouched: this only delays a resumption, and a fenced lease publishes nothing meanwhile.

Rejected: letting a fenced leader's in-flight deliveries finish (and purging the rows they
delivered) instead of purging its producer at once. The fence exists because another reaper may
lead after the session timeout, and nothing bounds when a record already handed to librdkafka
reaches the broker: it is retried until delivered (message.timeout.ms=0 keeps per-key order), so
one the old leader kept could land after the new leader's copy of a later row of its key, and
order would go backwards. Deliveries already reported are purged anyway; the records still in
flight at a fence are the ones Kafka was not answering for.
"""

from __future__ import annotations

MAX_STEADY_FACTOR = 4  # bound of the doubling: a flapping path delays resumption 4 x resume_steady at most
# A heartbeat older than this share of heartbeat_timeout breaks the run: heartbeats queued through
# a failover and acknowledged late (each leaving a lease of a fraction of a second) never add up to
# one. Below 1, so a resumed lease starts with a margin; above 1/2, so a broker answering within
# half the timeout (which keeps a leader leading) lets a fenced one resume too.
FRESH = 0.75


class Resumption:
    """One lease's resumption rule (see the module docstring); driven by the election thread only."""

    def __init__(self, steady: float, flap_window: float, hb_timeout: float) -> None:
        self.steady, self.flap_window = steady, flap_window
        # resume_steady 0: the first heartbeat back within the timeout resumes, as it used to
        self.fresh = FRESH * hb_timeout if steady else hb_timeout
        self.needed = steady  # seconds of steady heartbeats the next resumption waits for
        self._since: float | None = None  # send time of the first heartbeat of the current run
        self._newest = 0.0  # send time of the newest heartbeat of the run
        self._resumed_at: float | None = None
        self.fenced_at = 0.0  # monotonic: when the current (or last) fence began

    def fenced(self, now: float) -> None:
        """The lease fenced at `now`: soon after a resumption, the next one waits longer."""
        self.fenced_at = now
        flapped = self._resumed_at is not None and now - self._resumed_at < self.flap_window
        self.needed = min(self.needed * 2, MAX_STEADY_FACTOR * self.steady) if flapped else self.steady
        self._since = None

    def ready(self, now: float, newest_sent: float, grace_over: bool) -> bool:
        """At each pulse of a fenced lease: `newest_sent` is the send time of its newest heartbeat
        back, `grace_over` that no stall grace is pending. True once the heartbeats sent over
        `needed` seconds came back, each pulse seeing one sent within `fresh`."""
        if not grace_over or now - newest_sent > self.fresh:
            self._since = None
            return False
        if self._since is None:
            self._since = newest_sent
        self._newest = newest_sent
        return newest_sent - self._since >= self.needed

    def steady_for(self) -> float:
        """Seconds of heartbeats (by send time) the current run covers."""
        return 0.0 if self._since is None else self._newest - self._since

    def resumed(self, now: float) -> None:
        self._resumed_at, self._since = now, None

    def acquired(self) -> None:
        """The partition was assigned anew: a new leadership, the old one's history is void."""
        self.needed, self._resumed_at, self._since = self.steady, None, None
