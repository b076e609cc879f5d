"""A TCP proxy in front of one Kafka broker that can swallow traffic: a network partition for one client.

The client bootstraps to the proxy; broker addresses in the broker's responses (metadata) are
rewritten to the proxy's port, so every connection of that client goes through it (single broker,
same host). `swallow()` makes the proxy read and discard everything in both directions without
closing anything: requests the client has written count as sent (in flight) and never reach the
broker, and no response comes back, like packets dropped by a partition. `heal()` forwards again.
`down()` is a stopped broker (connections closed, new ones refused) until `up()`.
`slow(seconds)` instead holds every request on its way to the broker for that long (each from the
time it arrived, so they do not queue behind one another): a broker that answers late, as one
whose request queue is long under load.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time


class BlackholeProxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind((host, 0))
        self._srv.listen(16)
        self.port = self._srv.getsockname()[1]
        self.address = f"{host}:{self.port}"
        # Broker address as it appears in a metadata response: host string, then int32 port.
        self._find = host.encode() + struct.pack(">i", int(port))
        self._repl = host.encode() + struct.pack(">i", self.port)
        self._swallow = threading.Event()
        self.delay = 0.0  # seconds each request is held on its way to the broker (see slow())
        self._closed = threading.Event()
        self._socks: list[socket.socket] = []
        self.swallowed_bytes = 0
        self.produced_bytes = 0  # Produce requests (API key 0) forwarded to the broker
        threading.Thread(target=self._accept, daemon=True).start()

    def swallow(self) -> None:
        self._swallow.set()

    def heal(self) -> None:
        self._swallow.clear()
        self.delay = 0.0

    def slow(self, seconds: float) -> None:
        self.delay = seconds

    def down(self) -> None:
        """Close every connection and refuse new ones (the port stays this proxy's)."""
        self._srv.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        self._socks = []

    def up(self) -> None:
        self._srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind((self.upstream[0], self.port))
        self._srv.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for s in [self._srv, *self._socks]:
            try:
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        srv = self._srv
        while not self._closed.is_set():
            try:
                client, _ = srv.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            up.settimeout(None)
            self._socks += [client, up]
            threading.Thread(target=self._pump, args=(client, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, True), daemon=True).start()

    def _read(self, src: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = src.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _pump(self, src: socket.socket, dst: socket.socket, from_broker: bool) -> None:
        frames: queue.Queue = queue.Queue()
        threading.Thread(target=self._forward, args=(frames, src, dst), daemon=True).start()
        try:
            while not self._closed.is_set():
                # Kafka frames: int32 size, then the body. Whole frames are forwarded or swallowed.
                size = self._read(src, 4)
                body = self._read(src, struct.unpack(">i", size)[0])
                if self._swallow.is_set():
                    self.swallowed_bytes += 4 + len(body)
                    continue
                if from_broker:
                    body = body.replace(self._find, self._repl)
                if not from_broker and body[:2] == b"\x00\x00":
                    self.produced_bytes += len(body)
                due = time.monotonic() + (0.0 if from_broker else self.delay)
                frames.put((due, size + body))
        except (OSError, ConnectionError):
            pass
        frames.put(None)

    def _forward(self, frames: queue.Queue, src: socket.socket, dst: socket.socket) -> None:
        """Sends each frame at its due time, in order."""
        try:
            while (item := frames.get()) is not None:
                due, frame = item
                if (wait := due - time.monotonic()) > 0:
                    time.sleep(wait)
                dst.sendall(frame)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
