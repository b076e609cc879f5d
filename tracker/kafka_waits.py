"""How long the tracker's Kafka clients wait on a broker that stops answering.

A broker that keeps its connections open but never answers (a paused process, a route that drops
packets) is given up by librdkafka only when a request to it times out: a produce request after
`request.timeout.ms` (30 s by default), a fetch, an offset commit, a group or a metadata request
after `socket.timeout.ms` (60 s), a new connection's handshake after
`socket.connection.setup.timeout.ms` (30 s). Kafka moves the silent broker's partition
leaderships away after its broker session timeout (9 s by default), but until the request times
out the client keeps waiting on the old connection: an `AckProducer.flush()` or an inbox
consumer's poll hangs half a minute or more after another broker could have taken the work.

These defaults give such a broker up after 15 s, the reaper's default session timeout: past Kafka's
default broker session timeout, so by then the partitions have a new leader that the request (sent again
on a fresh connection, idempotently) reaches, yet long enough that a broker that is only slow
(a long GC pause, a saturated disk) is not given up, which would fail every request in flight on
that connection for nothing. A killed broker needs none of this: its connections are refused and
librdkafka asks for the new leaders at once. Settings the caller passes override every one.

Measured on the local three-broker cluster, the ack topic's leader paused: an AckProducer's
flush() returned 61.6 s after the pause at librdkafka's defaults, 16.2 s at these (16.1 s with
only request.timeout.ms or only the two socket ones at 15 s: any request that times out closes
the connection, failing the others on it too; both are kept, each bounds requests the other does
not, a consumer's and a fresh connection's). A 1 s
`topic.metadata.refresh.interval.ms` on top returned 2.6 s after the pause once, 16.2 s after it
another time (the refresh itself can go to the silent broker), so it is left to the caller: it
would add a metadata request a second per application instance for a gain that is not assured.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

SILENT_BROKER_WAIT_MS: Final = 15_000
SOCKET_TIMEOUT_MAX_MS: Final = 300_000  # librdkafka's bound of socket.timeout.ms

# Any librdkafka client (a consumer has no request.timeout.ms: it is a producer property).
CLIENT_DEFAULTS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "socket.timeout.ms": SILENT_BROKER_WAIT_MS,
        "socket.connection.setup.timeout.ms": SILENT_BROKER_WAIT_MS,
    }
)

# A producer: also its produce requests' own timeout.
PRODUCER_DEFAULTS: Final[Mapping[str, int]] = MappingProxyType(
    {**CLIENT_DEFAULTS, "request.timeout.ms": SILENT_BROKER_WAIT_MS}
)


def with_waits(conf: Mapping[str, object], *, producer: bool) -> dict[str, object]:
    """`conf` (a client's librdkafka settings) with the defaults above that fit it beneath it: the
    caller's own settings win. A transactional producer keeps librdkafka's own socket timeout,
    which it derives from `transaction.timeout.ms` and refuses above it; a consumer that waits
    longer on an empty fetch (`fetch.wait.max.ms`) gets a socket timeout a second past that wait,
    so its fetches are not cut short."""
    waits: dict[str, object] = dict(PRODUCER_DEFAULTS if producer else CLIENT_DEFAULTS)
    if producer and "transactional.id" in conf:
        del waits["socket.timeout.ms"]
    fetch_wait = conf.get("fetch.wait.max.ms")
    if not producer and isinstance(fetch_wait, (int, str)) and str(fetch_wait).isdigit():
        waits["socket.timeout.ms"] = min(SOCKET_TIMEOUT_MAX_MS, max(SILENT_BROKER_WAIT_MS, int(fetch_wait) + 1000))
    return {**waits, **conf}
