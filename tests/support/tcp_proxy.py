"""TCP proxies to one upstream address, on an address of the test's own.

`TcpProxy` forwards every connection byte for byte in both directions. Its port is bound at once,
so it is the proxy's from the start; with `listening=False` nothing listens on it yet: connecting
is refused (as with no server on the port) until `up()`. `down()` is a stopped server (connections
closed, new ones refused) until `up()`.

`KafkaProxy` stands in front of one Kafka broker and can swallow traffic: a network partition for
one client. The client bootstraps to the proxy; broker addresses in the broker's responses
(metadata) are rewritten to the proxy's port, so every connection of that client goes through it
(single broker, same host). `swallow()` makes the proxy read and discard everything in both
directions without closing anything: requests the client has written count as sent (in flight) and
never reach the broker, and no response comes back, like packets dropped by a partition. `heal()`
forwards again. `slow(seconds)` instead holds every request on its way to the broker for that long
(each from the time it arrived, so they do not queue behind one another): a broker that answers
late, as one whose request queue is long under load.
"""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time
from collections.abc import Iterable


def _close_all(socks: Iterable[socket.socket]) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)  # close() alone does not wake a recv() blocked in another thread
        except OSError:
            pass
        try:
            s.close()
        except OSError:
            pass


class TcpProxy:
    def __init__(self, upstream: str, host: str = "127.0.0.1", listening: bool = True) -> None:
        up_host, up_port = upstream.rsplit(":", 1)
        self.upstream = (up_host, int(up_port))
        self.host = host
        self._srv = self._bind(0)
        self.port = self._srv.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._closed = threading.Event()
        if listening:
            self.up()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def up(self) -> None:
        """Accept connections (again, after `down()`, on the same port)."""
        if self._srv.fileno() == -1:  # closed by down()
            self._srv = self._bind(self.port)
        self._srv.listen(16)
        threading.Thread(target=self._accept, args=(self._srv,), daemon=True, name="proxy-accept").start()

    def down(self) -> None:
        """Close every connection and refuse new ones (the port stays this proxy's)."""
        _close_all([self._srv])  # shut down first: close() alone leaves a blocked accept() one more connection
        _close_all(self._socks)
        self._socks = []

    def close(self) -> None:
        self._closed.set()
        _close_all([self._srv, *self._socks])

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bind(self, port: int) -> socket.socket:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((self.host, port))  # bound, not listening: connections are refused
        return srv

    def _accept(self, srv: socket.socket) -> None:
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
            if srv.fileno() == -1:  # taken down while this connection was being made
                _close_all((client, up))
                return
            self._socks += [client, up]
            for src, dst, from_upstream in ((client, up, False), (up, client, True)):
                args = (src, dst, from_upstream)
                threading.Thread(target=self._pump, args=args, daemon=True, name="proxy-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            _close_all((src, dst))


class KafkaProxy(TcpProxy):
    def __init__(self, upstream: str, listening: bool = True) -> None:
        host, port = upstream.rsplit(":", 1)
        # Broker address as it appears in a metadata response: host string, then int32 port.
        self._find = host.encode() + struct.pack(">i", int(port))
        self._swallow = threading.Event()
        self.delay = 0.0  # seconds each request is held on its way to the broker (see slow())
        self.swallowed_bytes = 0
        self.produced_bytes = 0  # Produce requests (API key 0) forwarded to the broker
        super().__init__(upstream, host=host, listening=False)
        self._repl = host.encode() + struct.pack(">i", self.port)
        if listening:
            self.up()

    def swallow(self) -> None:
        self._swallow.set()

    def heal(self) -> None:
        self._swallow.clear()
        self.delay = 0.0

    def slow(self, seconds: float) -> None:
        self.delay = seconds

    @staticmethod
    def _read(src: socket.socket, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = src.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("closed")
            buf += chunk
        return buf

    def _pump(self, src: socket.socket, dst: socket.socket, from_upstream: bool) -> None:
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
                if from_upstream:
                    body = body.replace(self._find, self._repl)
                if not from_upstream and body[:2] == b"\x00\x00":
                    self.produced_bytes += len(body)
                due = time.monotonic() + (0.0 if from_upstream else self.delay)
                frames.put((due, size + body))
        except (OSError, ConnectionError):
            pass
        frames.put(None)

    @staticmethod
    def _forward(frames: queue.Queue, src: socket.socket, dst: socket.socket) -> None:
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
            _close_all((src, dst))
