"""What the routes of API v1 share: their path and header parameters and their documented errors."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated

from annotated_types import Ge, Le
from fastapi import Header, Path
from pydantic import BeforeValidator

from harvester.services.http import models, problems

ID_MAX = (1 << 63) - 1
_CANONICAL = re.compile(r"0|[1-9][0-9]{0,18}")


def _canonical_decimal(value: object) -> object:
    # Path parameters arrive as text: only '0' or digits without a leading zero name a batch (no
    # sign, spaces, fraction, '_' separators or non-ASCII digits, which int() would take).
    if isinstance(value, str) and not _CANONICAL.fullmatch(value):
        raise ValueError("a batch id is written as a plain decimal: digits, no sign, spaces or leading zeros")
    return value


IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description='a quoted key, e.g. "8e03978e-40d5": a retry with the same key and request gets the first answer '
        "back and changes nothing (kept for http.idempotency_window)",
    ),
]
BatchId = Annotated[int, Path(description="batch id"), Ge(0), Le(ID_MAX), BeforeValidator(_canonical_decimal)]
_ERRORS = {  # documented responses of every /v1 route (besides its own)
    400: "invalid-request, malformed-item-id",
    401: "unauthorized",
    413: "payload-too-large",
    415: "unsupported-media-type",
    429: "rate-limited",
    500: "internal",
    503: "unavailable",
}

# What recording outcomes (acks, failures) can answer besides every route's errors.
ACK_PROBLEMS = (
    "batch-expired",
    "unknown-batch-in-body",
    "unknown-group",
    "index-out-of-range",
    "idempotency-key-reused",
)


def too_many_ids(count: int, limit: int) -> problems.ProblemException:
    """The refusal of a body naming more than http.max_ids_per_request ids or runs (413)."""
    return problems.ProblemException(
        problems.Problem(
            "payload-too-large",
            f"{count} ids: this server takes at most {limit} ids or runs per request",
            field="body.ids",
            limit=limit,
        )
    )


def body_bound(max_ids: int) -> Callable[[object], None]:
    """The check of a parsed body before its values are (strict_json.loads's `bound`): a list of
    `ids` longer than `max_ids` is refused before anything walks it."""

    def bound(value: object) -> None:
        ids = value.get("ids") if isinstance(value, dict) else None
        if isinstance(ids, list) and len(ids) > max_ids:
            raise too_many_ids(len(ids), max_ids)

    return bound


def responses(*extra: int | str) -> dict:
    """The documented error responses of a route: every route's, and its own, each named by a
    problem type's slug or by a status code (every type of that code). Types of one code share its
    entry, their titles joined, so that none is lost."""
    unknown = [e for e in extra if isinstance(e, str) and e not in problems.TYPES]
    if unknown:
        raise ValueError(f"no such problem type: {unknown}")
    codes: dict[int, list[str]] = {c: [d] for c, d in _ERRORS.items()}
    for slug, (code, title) in problems.TYPES.items():
        if (slug in extra or code in extra) and code not in _ERRORS and title not in codes.setdefault(code, []):
            codes[code].append(title)
    return {
        c: {"model": models.ProblemDoc, "description": "; ".join(d), "content": {problems.MEDIA_TYPE: {}}}
        for c, d in sorted(codes.items())
    }
