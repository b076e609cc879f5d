"""A free TCP port on the loopback address, for a server a test or bench starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picked it; it stays free unless something else takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
