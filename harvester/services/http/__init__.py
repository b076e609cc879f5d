"""The tracker over HTTP: `reaper serve` (server.py), the ASGI app (app.py)."""

from harvester.services.http.app import create_app

__all__ = ["create_app"]
