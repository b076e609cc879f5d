"""Request bodies read one way only: JSON that two parsers could read differently is refused.

A body must be UTF-8 (RFC 8259), may not name a key twice in one object (which one wins differs
between parsers), and no string in it may hold a NUL or an unpaired surrogate (neither can be
stored in Postgres text nor written back in a UTF-8 response). Numbers are JSON's: no NaN or
Infinity (which RFC 8259 does not have, and Python's parser takes), none that overflows a double to
infinity, no integer longer than the interpreter converts. Arrays and objects nest at most
NESTING_MAX deep. The error names the field as a path (`body.ids[3]`), never echoes the bad text.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from harvester.services.http.offload import CpuThreads
from harvester.services.http.problems import Problem, ProblemException

# Bodies up to this size are parsed on the event loop (well under a millisecond); larger in a thread.
_PARSE_ON_LOOP_MAX = 64 * 1024
# A NUL, or a UTF-16 surrogate left alone by a "\ud800" escape (a valid pair decodes to one character).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
# The escapes in a body's text that can make either: \u0000 and \ud800 to \udfff (a pair too).
_ESCAPED_UNSTORABLE = re.compile(r"\\u(?:0000|[dD][89a-fA-F])")
# Values with nothing to check: ints are converted or _NotJSON, floats may be infinite, strings may
# hold what _UNSTORABLE finds unless the text has no escape for it.
_PLAIN = frozenset({int, bool, type(None)})
_PLAIN_CLEAN = _PLAIN | {str}
# Arrays and objects inside one another, at most (the API's bodies need two): checked on the parsed
# value. json.loads recurses once per level and stops with a RecursionError at the interpreter's
# recursion limit, whatever the body's depth (its cost bounded by that limit), refused as this is. A
# scan of the body before parsing would cost more than the parse it guards (0.7 s for 4 MiB of "[]").
NESTING_MAX = 64


class _NotJSON:
    """A value json.loads reads but JSON has not (NaN, Infinity, an integer too long to convert):
    left in the parsed value for the check after parsing to report with its field's path."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _constant(name: str) -> _NotJSON:
    return _NotJSON(f"{name} is not a JSON number (JSON has no NaN or Infinity)")


def _integer(digits: str) -> int | _NotJSON:
    try:
        return int(digits)  # the interpreter counts the digits before it converts anything
    except ValueError:
        limit = sys.get_int_max_str_digits()
        return _NotJSON(f"the integer has more than the {limit} digits this server reads")


class UnreadableBody(ValueError):
    def __init__(self, field: str, reason: str) -> None:
        field = field if len(field) <= 200 else field[:200] + "..."
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            shown = json.dumps(key if len(key) <= 40 else key[:40] + "...")
            raise UnreadableBody("body", f"the key {shown} appears twice in one object")
        out[key] = value
    return out


def loads(body: bytes, bound: Callable[[object], None] | None = None) -> object:
    """The body's JSON value; raises UnreadableBody, or json.JSONDecodeError for text that is not JSON.
    `bound` sees the parsed value before it is checked value by value (a count past a limit is
    refused without that walk) and raises what it refuses."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableBody("body", f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_constant, parse_int=_integer)
    except RecursionError:
        raise UnreadableBody("body", f"arrays and objects nest more than {NESTING_MAX} levels deep") from None
    if bound is not None:
        bound(value)
    # Decoded UTF-8 holds no surrogate and the parser refuses a raw NUL in a string: only an escape
    # makes one. Without such an escape in the text, no string needs looking at.
    _check_values(value, strings_clean=_ESCAPED_UNSTORABLE.search(text) is None)
    return value


def _check_values(value: object, *, strings_clean: bool = False) -> None:
    # Iterative; containers are walked, and within one only values of a kind that can be wrong are
    # looked at one by one (a list of plain strings costs one pass in C). A field's path is spelled
    # out only for the one reported: each container carries a link to its parent.
    plain = _PLAIN_CLEAN if strings_clean else _PLAIN
    if not isinstance(value, dict | list):
        _check_scalar(value, None)
        return
    stack: list[tuple[dict | list, tuple[object, str | int] | None, int]] = [(value, None, 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth == NESTING_MAX:
            raise UnreadableBody(_path(where), f"arrays and objects nest more than {NESTING_MAX} levels deep")
        children: Iterable[tuple[str | int, object]]
        if isinstance(item, dict):
            if not strings_clean:
                for key in item:
                    if _UNSTORABLE.search(key) is not None:
                        raise UnreadableBody(_path(where), "a key holds a NUL character or an unpaired surrogate")
            if set(map(type, item.values())) <= plain:
                continue
            children = item.items()
        else:
            if set(map(type, item)) <= plain:
                continue
            children = enumerate(item)
        for step, child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, (where, step), depth + 1))  # type: ignore[arg-type]
            elif kind not in plain:
                _check_scalar(child, (where, step))


def _check_scalar(item: object, where: tuple[object, str | int] | None) -> None:
    if isinstance(item, _NotJSON):
        raise UnreadableBody(_path(where), item.reason)
    if isinstance(item, float) and not math.isfinite(item):
        raise UnreadableBody(_path(where), "the number is too large: it overflows a double to infinity")
    if isinstance(item, str):
        bad = _UNSTORABLE.search(item)
        if bad is not None:
            what = "a NUL character" if bad.group() == "\x00" else "an unpaired UTF-16 surrogate"
            raise UnreadableBody(_path(where), f"the text holds {what} at position {bad.start()}")


def _path(where: tuple[object, str | int] | None) -> str:
    parts: list[str] = []
    while where is not None:
        parent, step = where
        parts.append(f"[{step}]" if isinstance(step, int) else f".{step if len(step) <= 40 else step[:40] + '...'}")
        where = parent  # type: ignore[assignment]
    return "body" + "".join(reversed(parts))


class StrictRequest(Request):
    """A request whose `json()` is `loads` above: FastAPI reads every body through it."""

    async def json(self) -> object:
        if not hasattr(self, "_json"):
            body = await self.body()
            app = self.scope.get("app")
            state = getattr(app, "state", None)
            cpu: CpuThreads | None = getattr(state, "cpu", None)  # create_app's
            bound = getattr(state, "body_bound", None)
            try:
                if len(body) <= _PARSE_ON_LOOP_MAX:
                    self._json = loads(body, bound)
                else:  # CPU work: on a thread, so it never holds up the event loop
                    self._json = await (cpu.run(loads, body, bound) if cpu else asyncio.to_thread(loads, body, bound))
            except UnreadableBody as exc:
                # an HTTPException: FastAPI's body reading passes it on as it is
                raise ProblemException(Problem("invalid-request", str(exc), field=exc.field)) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """The app's route class: its handlers get a StrictRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictRequest(request.scope, request.receive))

        return strict
