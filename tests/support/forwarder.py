"""A plain TCP forwarder to one upstream address that refuses connections until it is opened: a
server (a Postgres primary, a broker) that is not up yet, on an address of the test's own.

The port is bound at once, so it is the forwarder's from the start, but nothing listens on it:
connecting is refused (as with no server on the port) until `open()`, which starts forwarding every
new connection, byte for byte in both directions, to the upstream address.
"""

from __future__ import annotations

import socket
import threading


class Forwarder:
    def __init__(self, upstream: str, host: str = "127.0.0.1") -> None:
        up_host, up_port = upstream.rsplit(":", 1)
        self.upstream = (up_host, int(up_port))
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind((host, 0))  # bound, not listening: connections are refused
        self.host, self.port = host, self._srv.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = threading.Event()
        self.accepted = 0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def open(self) -> None:
        self._srv.listen(16)
        threading.Thread(target=self._accept, daemon=True, name="forwarder-accept").start()

    def close(self) -> None:
        self._closed.set()
        for s in [self._srv, *self._socks]:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> Forwarder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            up.settimeout(None)
            self.accepted += 1
            self._socks += [client, up]
            for src, dst in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True, name="forwarder-pump").start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
