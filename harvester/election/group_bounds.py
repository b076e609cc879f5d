"""The brokers' bounds on a group's session timeout, checked against the leader group's before it joins.

A broker refuses a JoinGroup whose session timeout lies outside its `group.min.session.timeout.ms`
to `group.max.session.timeout.ms` (6 s to 30 min by default). librdkafka then retries the join
for ever, and the reaper never leads: every few seconds it sees its leader consumer out of the
group and makes a new one, with nothing in the log saying why. So the bounds are read from every
broker (DescribeConfigs) at start, and a session timeout outside any of them is refused with both
figures named. Brokers that do not let the reaper read their configuration are not checked.
"""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from harvester import logs

MIN_KEY, MAX_KEY = "group.min.session.timeout.ms", "group.max.session.timeout.ms"


class SessionTimeoutRefused(RuntimeError):
    """The leader group's session timeout is outside what a broker accepts from a group member."""


def broker_session_bounds(admin: AdminClient, timeout: float) -> dict[int, tuple[int, int]]:
    """Each broker's (group.min.session.timeout.ms, group.max.session.timeout.ms), by broker id; a
    broker whose configuration cannot be read (no DescribeConfigs right, no answer) is left out."""
    brokers = sorted(admin.list_topics(timeout=timeout).brokers)
    resources = [ConfigResource(ResourceType.BROKER, str(b)) for b in brokers]
    if not resources:
        return {}
    futures = admin.describe_configs(resources, request_timeout=timeout)
    bounds: dict[int, tuple[int, int]] = {}
    for resource, future in futures.items():
        try:
            entries = future.result(timeout=timeout)
            low, high = int(entries[MIN_KEY].value), int(entries[MAX_KEY].value)
        except (KafkaException, KeyError, TypeError, ValueError, TimeoutError) as exc:  # (a broker slow to answer)
            logs.get("reaper.neli").warning(
                "cannot read a broker's session timeout bounds: not checked",
                broker=resource.name,
                error=str(exc.args[0]) if isinstance(exc, KafkaException) else repr(exc),
            )
            continue
        bounds[int(resource.name)] = (low, high)
    return bounds


def check_session_timeout(admin: AdminClient, session_timeout_ms: int, timeout: float = 30.0) -> None:
    """Raise SessionTimeoutRefused when `session_timeout_ms` lies outside any broker's bounds."""
    try:
        bounds = broker_session_bounds(admin, timeout)
    except KafkaException as exc:
        error = exc.args[0]
        if isinstance(error, KafkaError) and error.code() in (
            KafkaError.CLUSTER_AUTHORIZATION_FAILED,
            KafkaError._TIMED_OUT,
        ):
            logs.get("reaper.neli").warning(
                "cannot read the brokers' session timeout bounds: not checked", error=error.str()
            )
            return
        raise
    for broker, (low, high) in sorted(bounds.items()):
        if not low <= session_timeout_ms <= high:
            raise SessionTimeoutRefused(
                f"harvester.session_timeout {session_timeout_ms / 1000:g} s: broker {broker} accepts a group "
                f"session timeout from {low / 1000:g} s ({MIN_KEY}) to {high / 1000:g} s ({MAX_KEY}), so the "
                "leader consumer could never join its group; set harvester.session_timeout inside that range "
                "(and harvester.heartbeat_timeout below it)"
            )
