"""RFC 9457 problem details: every error the HTTP service returns is one of these documents.

A problem names what was wrong (`field`, `item_id` or `batch_id`) and never carries a stack trace:
unexpected exceptions become a bare 500 whose only detail is the request id, the traceback going to
the log.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from tracker.errors import (
    BatchExpired,
    BatchNotOpen,
    IndexOutOfRange,
    MalformedItemId,
    TooManyGroups,
    TrackerError,
    UnknownBatch,
    UnknownGroup,
)

MEDIA_TYPE = "application/problem+json"
TYPE_BASE = "urn:outbox-reaper:problem:"

# slug -> (status, title): the documented set (docs/howto/http.md, "Read errors"; OpenAPI components).
TYPES: dict[str, tuple[int, str]] = {
    "invalid-request": (400, "The request is not valid"),
    "malformed-item-id": (400, "Malformed item id"),
    "unauthorized": (401, "Missing or wrong bearer token"),
    "forbidden": (403, "Not allowed for this tenant"),
    "not-found": (404, "No such resource"),
    "unknown-batch": (404, "Unknown batch"),
    "method-not-allowed": (405, "Method not allowed"),
    "parent-not-open": (409, "Parent batch is not open"),
    "batch-not-open": (409, "Batch is not open"),
    "batch-expired": (410, "Batch has expired"),
    "payload-too-large": (413, "Request body too large"),
    "misdirected-request": (421, "Not addressed to a loopback name"),
    "unsupported-media-type": (415, "Request body must be application/json"),
    "nesting-too-deep": (422, "Batches nest too deep"),
    "unknown-group": (422, "Unknown group"),
    "index-out-of-range": (422, "Item index out of range"),
    "idempotency-key-reused": (422, "Idempotency-Key used for another request"),
    "unknown-batch-in-body": (422, "Unknown batch"),
    "rate-limited": (429, "Too many requests"),
    "internal": (500, "Internal server error"),
    "unavailable": (503, "Service unavailable"),
}


class Problem(Exception):
    """Raise anywhere in a request: becomes the problem document of `slug`."""

    def __init__(
        self, slug: str, detail: str, *, headers: Mapping[str, str] | None = None, **extensions: object
    ) -> None:
        super().__init__(detail)
        self.slug, self.detail, self.headers = slug, detail, dict(headers or {})
        self.status = TYPES[slug][0]
        self.extensions = {k: v for k, v in extensions.items() if v is not None}


class ProblemException(StarletteHTTPException):
    """A problem raised where only an HTTPException passes through as it is (FastAPI's body parsing)."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.status, problem.detail)
        self.problem = problem


def _utf8(value: object) -> object:
    """What a JSON response can carry: an unpaired surrogate in what a caller sent is escaped, and a
    number JSON has not (NaN, an infinity) is written as text, in lists and objects too."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list | tuple):
        return [_utf8(v) for v in value]
    if isinstance(value, dict):
        return {_utf8(k): _utf8(v) for k, v in value.items()}
    return value


def response(problem: Problem, instance: str) -> JSONResponse:
    status, title = TYPES[problem.slug]
    body = {
        "type": TYPE_BASE + problem.slug,
        "title": title,
        "status": status,
        "detail": _utf8(problem.detail),
        "instance": _utf8(instance),
        **{k: _utf8(v) for k, v in problem.extensions.items()},
    }
    return JSONResponse(body, status_code=status, media_type=MEDIA_TYPE, headers=problem.headers)


def from_tracker(exc: TrackerError, *, batch_in_path: bool) -> Problem:
    """The problem for a tracker error; `batch_in_path`: the batch was named by the URL, not the body."""
    if isinstance(exc, MalformedItemId):
        return Problem("malformed-item-id", str(exc), item_id=_text(exc.item_id), field="ids")
    if isinstance(exc, TooManyGroups):
        return Problem(
            "payload-too-large", str(exc), item_id=_text(exc.item_id), field="body.ids", limit=exc.limit_bytes
        )
    if isinstance(exc, IndexOutOfRange):
        return Problem("index-out-of-range", str(exc), item_id=exc.item_id, field="ids")
    if isinstance(exc, UnknownGroup):
        return Problem(
            "unknown-group", str(exc), batch_id=exc.batch_id, group_id=exc.group_id, item_id=exc.item_id, field="ids"
        )
    if isinstance(exc, UnknownBatch):
        slug = "unknown-batch" if batch_in_path else "unknown-batch-in-body"
        return Problem(
            slug, str(exc), batch_id=exc.batch_id, item_id=exc.item_id, field=None if batch_in_path else "ids"
        )
    if isinstance(exc, BatchNotOpen):
        return Problem("batch-not-open", str(exc), batch_id=exc.batch_id, state=exc.state)
    if isinstance(exc, BatchExpired):
        return Problem("batch-expired", str(exc), batch_id=exc.batch_id, item_id=exc.item_id)
    name = getattr(exc, "name", None)  # InvalidArgument / InvalidValue name the argument
    field = _FIELDS.get(name) if isinstance(name, str) else None
    return Problem("invalid-request", str(exc), field=field or "body")


# The tracker's argument names -> the request fields that carry them.
_FIELDS = {
    "n": "body.count",
    "user_key": "body.user_key",
    "completion_topic": "body.completion_topic",
    "item_ids": "body.ids",
    "reason": "body.reason",
    "parent": "body.parent",
    "tolerated_failures": "body.tolerated_failures",
    "tolerated_failure_ratio": "body.tolerated_failure_ratio",
}


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("ascii", "backslashreplace")
    return value if isinstance(value, str) else repr(value)
