"""Print the HTTP API's OpenAPI document, as the server serves it at /v1/openapi.json.

    .venv/bin/python -m harvester.services.http.openapi > harvester/services/http/openapi.json   # regenerate the checked-in copy

tests/test_http_api.py fails when the checked-in copy differs from what a running server serves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harvester import config
from harvester.services.http.app import create_app

CHECKED_IN = Path(__file__).resolve().parent / "openapi.json"


def document() -> dict:
    app = create_app(config.load(environ={}), tokens=["x" * 16])
    return app.fastapi.openapi()


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(document()))
