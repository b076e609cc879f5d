"""The two requeue flows of the console, dead rows and dead-lettered acks, told apart by a Flow:
what names one of them (a dead row's id, a dead letter's partition:offset), where the pages are and
what they say. Both are the same steps: a confirmation page naming what will move (its token tied to
the session and that target), then a POST checked in order (session, CSRF, operator, an operator
of the outbox, a target named, the confirmation page's token), then the admin command."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tracker.ids import ID_MAX


@dataclass(frozen=True)
class Target:
    """One (`one`, as the form writes it), those whose reason contains `reason`, or all."""

    one: str | None
    reason: str | None
    everything: bool

    @property
    def named(self) -> bool:
        return self.one is not None or self.reason is not None or self.everything


@dataclass(frozen=True)
class Flow:
    action: str  # the confirmation token's action: "<action>:<field>:<one>", "<action>:reason:<text>", "<action>:all"
    field: str  # the form field naming one: its parser gives it back as written, or None
    parse_one: Callable[[str | None], str | None]
    path: str  # the list page; the confirmation page and the POST are at path + "/requeue"
    nothing: str  # no target named (400)
    shared: str  # a tenant's token (403)
    unconfirmed: str  # not posted from its confirmation page (403)

    def target(self, params: Mapping[str, str]) -> Target:
        one = self.parse_one(params.get(self.field))
        reason = (params.get("reason") or "")[:1000] or None
        if reason is not None and "\x00" in reason:
            reason = None
        return Target(one, None if one is not None else reason, params.get("all") == "1")

    def confirmation_key(self, t: Target) -> str:
        if t.one is not None:
            return f"{self.action}:{self.field}:{t.one}"
        return f"{self.action}:all" if t.reason is None else f"{self.action}:reason:{t.reason}"


def _dead_id(text: str | None) -> str | None:
    t = (text or "").strip()
    if not t.isascii() or not t.isdigit() or len(t) > 19 or not 1 <= int(t) <= ID_MAX:
        return None
    return str(int(t))


_AT = re.compile(r"([0-9]{1,7}):([0-9]{1,19})")


def _at(text: str | None) -> str | None:
    m = _AT.fullmatch(text or "")
    return None if m is None else f"{int(m.group(1))}:{int(m.group(2))}"


def at_of(t: Target) -> tuple[int, int] | None:
    """A dead letter's (partition, offset), from a target of ACKS."""
    if t.one is None:
        return None
    p, _, o = t.one.partition(":")
    return int(p), int(o)


DEAD = Flow(
    action="requeue",
    field="id",
    parse_one=_dead_id,
    path="/console/dead",
    nothing="Name a dead row id, a reason, or all.",
    shared="The outbox is shared: only operators act on it.",
    unconfirmed="Requeue from its confirmation page, which says what will move.",
)
ACKS = Flow(
    action="acks-requeue",
    field="at",
    parse_one=_at,
    path="/console/dead-acks",
    nothing="Name a dead letter (partition:offset), a reason, or all.",
    shared="The ack topic is shared: only operators act on it.",
    unconfirmed="Requeue from its confirmation page, which says what will be sent.",
)
