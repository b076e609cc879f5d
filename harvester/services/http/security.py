"""Bearer tokens (compared in constant time), the per-token rate limit, the wrong-token limit per
address, and the body size limit."""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import re
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping

from starlette.exceptions import HTTPException as StarletteHTTPException

from harvester.config import ConfigError, HttpConfig

Scope = MutableMapping[str, object]
Message = MutableMapping[str, object]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def headers_of(event: Scope | Message) -> Iterable[tuple[bytes, bytes]]:
    """The `headers` of an ASGI scope or message: (name, value) byte pairs."""
    headers = event.get("headers", [])
    assert isinstance(headers, Iterable), "ASGI: headers are an iterable of byte pairs"
    return headers


def state_of(scope: Scope) -> MutableMapping[str, object]:
    """The request's ASGI `state`, shared by the layers and the app (created if the server sent none)."""
    state = scope.setdefault("state", {})
    assert isinstance(state, MutableMapping), "ASGI: scope['state'] is a dict"
    return state


# What a bearer token may hold: printable ASCII, as an Authorization header carries it.
_PRESENTABLE = re.compile(r"[\x21-\x7e]+")
# A tokens or tenants file holds tokens or their hashes: a few hundred bytes each. Larger is
# refused unread.
FILE_MAX_BYTES = 4 << 20


def read_text(path: str, key: str) -> str:
    """A configuration file's text: at most FILE_MAX_BYTES, UTF-8, else ConfigError naming `key`."""
    with open(path, "rb") as f:
        raw = f.read(FILE_MAX_BYTES + 1)
    if len(raw) > FILE_MAX_BYTES:
        raise ConfigError(key, f"{path} is larger than {FILE_MAX_BYTES:,} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(key, f"{path} is not UTF-8 text (byte {exc.start})") from None


def load_tokens(cfg: HttpConfig) -> list[str]:
    """Tokens from http.tokens (comma-separated) and http.tokens_file (one per line, '#' comments)."""
    found = [("http.tokens", t.strip()) for t in cfg.tokens.split(",") if t.strip()]
    if cfg.tokens_file:
        try:
            text = read_text(cfg.tokens_file, "http.tokens_file")
        except OSError as exc:
            raise ConfigError("http.tokens_file", f"cannot read {cfg.tokens_file}: {exc.strerror}") from None
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                found.append(("http.tokens_file", line))
    for where, t in found:
        if len(t) < 16 or any(c.isspace() for c in t):
            raise ConfigError(
                where, f"every token must be at least 16 characters with no spaces (token {token_id(t)} is not)"
            )
        if not _PRESENTABLE.fullmatch(t):
            # A client sends its token in a header, which is read as bytes (latin-1): another character
            # would be compared as bytes other than the ones configured, and never match.
            raise ConfigError(
                where, f"token {token_id(t)} holds a character other than printable ASCII, which a header cannot carry"
            )
    return [t for _, t in found]


def check_startup(cfg: HttpConfig, tokens: list[str]) -> None:
    """Refuse to serve without tokens unless explicitly in local mode, on a loopback address."""
    if tokens or cfg.tenants_file:
        return
    if not cfg.local_mode:
        raise ConfigError(
            "http.tokens",
            "no bearer tokens configured (http.tokens or http.tokens_file); "
            "set http.local_mode: true to serve without authentication on a loopback address",
        )
    try:
        loopback = ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        loopback = cfg.host == "localhost"
    if not loopback:
        raise ConfigError("http.local_mode", f"serves without tokens, so only on a loopback address, not {cfg.host!r}")


def loopback_host(host: bytes | None) -> bool:
    """Whether a Host header names this machine: localhost, 127.0.0.0/8 or ::1 (any port). In local
    mode, where no token is asked, anything else is a page whose name was rebound to 127.0.0.1 (DNS
    rebinding) reaching the service from the operator's own browser as its own origin."""
    if not host:
        return False
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        name = text[1:].partition("]")[0]
    else:
        name = text.rpartition(":")[0] if text.count(":") == 1 else text
    if name in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def token_id(token: str) -> str:
    """A short stable name for a token, for logs, metrics and rate limiting (never the token)."""
    return "tok-" + hashlib.sha256(token.encode()).hexdigest()[:10]


class RateLimiter:
    """A token bucket per key (a bearer token, a client address): `rate` requests per second,
    bursts of up to `burst`. At most `max_keys` buckets are kept: a full bucket is the same as none,
    so those go first; under a flood of new keys, the least recently used go next."""

    def __init__(
        self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic, max_keys: int = 10_000
    ) -> None:
        self.rate, self.burst, self.clock, self.max_keys = rate, burst, clock, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # oldest use first

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str) -> float:
        """0 if a request may go ahead now, else the seconds until it may."""
        if self.rate <= 0:
            return 0.0
        now = self.clock()
        level, last = self._buckets.pop(key, (float(self.burst), now))
        level = min(float(self.burst), level + (now - last) * self.rate)
        if len(self._buckets) >= self.max_keys:
            self._prune(now)
        if level >= 1.0:
            self._buckets[key] = (level - 1.0, now)
            return 0.0
        self._buckets[key] = (level, now)
        return (1.0 - level) / self.rate

    def waiting(self, key: str) -> float:
        """The seconds until `key` may go ahead (0: now), taking nothing."""
        if self.rate <= 0 or key not in self._buckets:
            return 0.0
        level, last = self._buckets[key]
        level = min(float(self.burst), level + (self.clock() - last) * self.rate)
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate

    def _prune(self, now: float) -> None:
        refilled = [k for k, (lv, at) in self._buckets.items() if lv + (now - at) * self.rate >= self.burst]
        for k in refilled:
            del self._buckets[k]
        if len(self._buckets) <= self.max_keys * 3 // 4:
            return
        for k in list(itertools.islice(self._buckets, len(self._buckets) - self.max_keys // 2)):
            del self._buckets[k]


class WrongTokens:
    """Wrong bearer tokens per client address (on /v1 and the console's login alike): bursts of
    `burst`, then `rate` a second. Only wrong tokens are counted. Once an address is over its limit,
    a wrong token is refused with 429, and so is a right one never used from that address before:
    the answer must not tell a guesser it found one. A right token that already authenticated from
    the address goes on through (it learns nothing new), so a client that keeps sending a stale or
    a guessed token does not lock out the others behind the same address."""

    def __init__(
        self, rate: float = 1.0, burst: int = 10, clock: Callable[[], float] = time.monotonic, max_known: int = 10_000
    ) -> None:
        self.bucket = RateLimiter(rate, burst, clock)
        self.max_known = max_known
        self._known: dict[tuple[str, str], None] = {}  # (address, token id), oldest use first

    def wrong(self, address: str) -> float:
        """Counts a wrong token from `address`: 0 to answer 401 now, else the seconds to wait (429)."""
        return self.bucket.take(address)

    def admits(self, address: str, token: str) -> float:
        """0 if a right token (by id) may go ahead from `address`, else the seconds to wait (429)."""
        key = (address, token)
        known = key in self._known
        self._known.pop(key, None)  # re-added below as the newest use
        wait = self.bucket.waiting(address)
        if wait > 0 and not known:
            return wait
        self._known[key] = None
        if len(self._known) > self.max_known:
            del self._known[next(iter(self._known))]
        return 0.0


class BodyTooLarge(StarletteHTTPException):
    """Raised while a chunked body is read past the limit (an HTTPException, so FastAPI's body
    reading passes it on as it is and it becomes the 413 problem)."""

    def __init__(self) -> None:
        super().__init__(413)


class BodyLimit:
    """ASGI middleware: a body over `limit` bytes is refused (413) before it is read whole, by its
    Content-Length or, for chunked bodies, as soon as the bytes received pass the limit."""

    def __init__(self, app: Callable, limit: int, refuse: Callable[[Scope, Send], Awaitable[None]]) -> None:
        self.app, self.limit, self.refuse = app, limit, refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in headers_of(scope):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.limit
                except ValueError:
                    too_big = False
                if too_big:
                    await self.refuse(scope, send)
                    return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))  # type: ignore[arg-type]
                if seen > self.limit:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self.refuse(scope, send)
