"""What the routes of API v1 share: their path and header parameters and their documented errors."""

from __future__ import annotations

import re
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


def responses(*extra: int) -> dict:
    """The documented error responses of a route: every route's, and its own `extra` status codes."""
    codes = {**_ERRORS, **{c: problems.TYPES[s][1] for s, (c, _) in problems.TYPES.items() if c in extra}}
    return {
        c: {"model": models.ProblemDoc, "description": d, "content": {problems.MEDIA_TYPE: {}}}
        for c, d in sorted(codes.items())
    }
