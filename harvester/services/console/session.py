"""Who is looking at the console: a login that trades a bearer token for a signed session cookie.

The cookie (HttpOnly, SameSite=Strict, Secure behind HTTPS) carries the session's id, its role,
its expiry and the SHA-256 digest of the token it was made from, signed with HMAC-SHA256. Every
request checks the signature, the expiry and that the token is still known (a token revoked from
the tenants file ends its sessions at once); the console also checks that the session was not
ended by a logout (harvester.services.console.logouts: recorded in the database, so a copy of the
cookie is refused by every server after it). Every POST carries a CSRF token derived from the
session id; the SameSite cookie is the first guard, the CSRF token the second.

Roles: `viewer` (console.viewer_tokens: reads) and `operator` (the HTTP API's tokens: reads and
acts). A tenant's token sees only its tenant's batches, and no outbox-wide page.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from harvester.config import ConfigError, ConsoleConfig
from harvester.services.http.tenants import DEFAULT, Caller, Tenant, TenantAuth

COOKIE = "reaper_console"
LOGIN_COOKIE = "reaper_console_login"  # the login form's own CSRF nonce (double submit)
VIEWER, OPERATOR = "viewer", "operator"


@dataclass(frozen=True)
class User:
    token: str  # the token's id for logs (tok-...), never the token
    tenant: str
    role: str
    session: str  # the session id ("local" without authentication)
    expires: float = 0.0  # unix time the session's cookie expires (0: never, without authentication)

    @property
    def may_act(self) -> bool:
        return self.role == OPERATOR

    @property
    def sees_outbox(self) -> bool:
        """The outbox, its leaders and dead rows are everyone's: only the default tenant sees them."""
        return self.tenant == DEFAULT


def _stat(path: str) -> tuple[float, int] | None:
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return None if st is None else (st.st_mtime, st.st_size)


def load_viewer_tokens(cfg: ConsoleConfig) -> list[str]:
    tokens = [t.strip() for t in cfg.viewer_tokens.split(",") if t.strip()]
    if cfg.viewer_tokens_file:
        try:
            text = Path(cfg.viewer_tokens_file).read_text()
        except OSError as exc:
            raise ConfigError(
                "console.viewer_tokens_file", f"cannot read {cfg.viewer_tokens_file}: {exc.strerror}"
            ) from None
        tokens += [line.split("#", 1)[0].strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]
    for t in tokens:
        if len(t) < 16 or any(c.isspace() for c in t):
            raise ConfigError("console.viewer_tokens", "every token must be at least 16 characters with no spaces")
    return tokens


class Sessions:
    """Logins, cookies and CSRF tokens. `auth` is the HTTP API's (operators); viewers are the console's."""

    def __init__(self, cfg: ConsoleConfig, auth: TenantAuth, viewer_tokens: list[str]) -> None:
        secret = cfg.session_secret
        if secret and len(secret) < 32:
            raise ConfigError("console.session_secret", "must be at least 32 characters (or empty: a random key)")
        self._key = hashlib.sha256(secret.encode()).digest() if secret else secrets.token_bytes(32)
        self._ttl, self._auth = cfg.session_ttl, auth
        self._viewers = {hashlib.sha256(t.encode()).digest() for t in viewer_tokens}
        self._cfg, self._viewers_seen, self._viewers_checked = cfg, _stat(cfg.viewer_tokens_file), 0.0
        self.enabled = auth.enabled  # local mode (no tokens): everyone is the local operator

    def _maybe_reload_viewers(self) -> None:
        """Read console.viewer_tokens_file again if it changed (at most once a second): a viewer token
        removed from it ends its sessions, as a revoked operator token does. A bad file keeps the old."""
        if not self._cfg.viewer_tokens_file or time.monotonic() - self._viewers_checked < 1.0:
            return
        self._viewers_checked = time.monotonic()
        seen = _stat(self._cfg.viewer_tokens_file)
        if seen == self._viewers_seen:
            return
        try:
            tokens = load_viewer_tokens(self._cfg)
        except ConfigError as exc:
            structlog.get_logger("reaper.http").error(
                "viewer tokens not reloaded: keeping those loaded", error=str(exc)
            )
            return
        self._viewers, self._viewers_seen = {hashlib.sha256(t.encode()).digest() for t in tokens}, seen

    def _caller(self, digest: bytes) -> tuple[Caller, str] | None:
        self._maybe_reload_viewers()
        viewer = any(hmac.compare_digest(digest, v) for v in self._viewers)
        caller = self._auth.identify_digest(digest)
        if caller is not None:
            return caller, OPERATOR
        if viewer:
            return Caller("tok-" + digest.hex()[:10], Tenant(DEFAULT, None), f"{DEFAULT}:viewer"), VIEWER
        return None

    def login(self, token: str) -> tuple[User, str] | None:
        """The user and the cookie value for a valid token, else None."""
        digest = hashlib.sha256(token.strip().encode("utf-8", "surrogateescape")).digest()
        found = self._caller(digest)
        if found is None:
            return None
        caller, role = found
        session, expires = secrets.token_urlsafe(16), int(time.time() + self._ttl)
        body = {"s": session, "d": self._sealed(session, digest).hex(), "r": role, "e": expires}
        raw = base64.urlsafe_b64encode(json.dumps(body, separators=(",", ":")).encode()).decode().rstrip("=")
        user = User(caller.token, caller.tenant.name, role, session, expires)
        return user, f"{raw}.{self._sign(raw)}"

    def user(self, cookie: str | None) -> User | None:
        """The user of a session cookie that is signed, unexpired and whose token is still valid."""
        if not self.enabled:
            return User("local", DEFAULT, OPERATOR, "local")
        if not cookie or cookie.count(".") != 1 or len(cookie) > 1024:
            return None
        raw, sig = cookie.split(".")
        if not hmac.compare_digest(sig.encode(), self._sign(raw).encode()):
            return None
        try:
            body = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
            sealed, role, expires, session = bytes.fromhex(body["d"]), body["r"], float(body["e"]), str(body["s"])
            digest = self._sealed(session, sealed)
        except (ValueError, KeyError, TypeError):
            return None
        if expires < time.time():
            return None
        self._auth.maybe_reload()
        found = self._caller(digest)
        if found is None or found[1] != role:
            return None  # revoked, or its role changed: log in again
        return User(found[0].token, found[0].tenant.name, role, session, expires)

    @staticmethod
    def nonce() -> str:
        return secrets.token_urlsafe(16)

    def csrf(self, user: User) -> str:
        return self._sign("csrf:" + user.session)

    def csrf_ok(self, user: User, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.csrf(user).encode())

    def confirmation(self, user: User, action: str) -> str:
        """The token of one confirmation page (this session, this action on this target): posting the
        action needs it, so the page that says what will happen cannot be skipped."""
        return self._sign(f"confirm:{user.session}:{action}")

    def confirmation_ok(self, user: User, action: str, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(token.encode(), self.confirmation(user, action).encode())

    def _sealed(self, session: str, digest: bytes) -> bytes:
        """The token's digest as the cookie carries it, and back: XORed with a pad only this key makes,
        one per session. The cookie is signed, not encrypted: its reader must not learn the digest, an
        offline guessing oracle for a token that outlives the session. ValueError if not 32 bytes."""
        pad = hmac.new(self._key, f"digest:{session}".encode(), hashlib.sha256).digest()
        return bytes(a ^ b for a, b in zip(digest, pad, strict=True))

    def _sign(self, text: str) -> str:
        mac = hmac.new(self._key, text.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")
