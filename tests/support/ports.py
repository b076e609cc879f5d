"""A free TCP port on the loopback address, for a server a test or bench starts; and a listener
that accepts connections and never answers."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


def free_port() -> int:
    """A port nothing listens on now (the OS picked it; it stays free unless something else takes it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_listener() -> Iterator[str]:
    """host:port of a listener on the loopback address that accepts every connection and never
    says a word; the connections are closed when the block ends."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(hole.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"127.0.0.1:{hole.getsockname()[1]}"
    finally:
        done.set()
        hole.close()
        for conn in held:
            conn.close()
