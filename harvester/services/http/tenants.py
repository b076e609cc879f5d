"""Tenants: who a bearer token speaks for, which batches it may see, which topics it may complete into.

`http.tenants_file` (YAML), re-read when it changes (checked at most once a second) and on SIGHUP,
so tokens are added and revoked without a restart; it holds hashes, never tokens:

    tenants:
      billing:
        tokens: ["sha256:9f86d081884c7d65..."]     # `reaper token new --tenant billing` makes one
        completion_topics: ["billing-done"]        # default: the server's default completion topic only

A batch belongs to the tenant whose token opened it; another tenant's batch answers exactly as one
that does not exist (404, nothing changed, nothing counted). Tokens of `http.tokens` and
`http.tokens_file` (and local mode) speak for the tenant `default`, which may use any completion
topic and also sees batches opened without a tenant (by the Python API or SQL).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from harvester.config import ConfigError
from harvester.config_yaml import load_yaml
from harvester.services.http import problems
from harvester.services.http.backend import Store
from harvester.services.http.offload import CpuThreads
from harvester.services.http.security import read_text, token_id
from tracker.errors import TrackerError, UnknownBatch
from tracker.ids import fold

DEFAULT = "default"
_HASH = re.compile(r"sha256:([0-9a-f]{64})")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


@dataclass(frozen=True)
class Tenant:
    name: str
    completion_topics: frozenset[str] | None  # None: any topic

    def may_complete_into(self, topic: str) -> bool:
        return self.completion_topics is None or topic in self.completion_topics


@dataclass(frozen=True)
class Caller:
    token: str  # the token's id (logs, metrics, rate limits), never the token
    tenant: Tenant
    scope: str  # what its Idempotency-Keys belong to: its tenant and its token's whole digest


LOCAL = Caller("local", Tenant(DEFAULT, None), f"{DEFAULT}:local")


def new_token() -> tuple[str, str]:
    """A fresh bearer token and the hash the tenants file holds for it."""
    token = secrets.token_urlsafe(32)
    return token, "sha256:" + hashlib.sha256(token.encode()).hexdigest()


def parse(text: str, default_topic: str, where: str = "http.tenants_file") -> list[tuple[bytes, Caller]]:
    """(token digest, caller) for every token of a tenants file; ConfigError naming what is wrong."""
    # The configuration's own YAML rules: no aliases, no key twice (a tenant written twice would
    # silently lose its first tokens), bounded nesting.
    data = load_yaml(text, where) or {}
    tenants = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(tenants, dict):
        raise ConfigError(where, "must hold a mapping `tenants: {name: {tokens: [...], completion_topics: [...]}}`")
    out: list[tuple[bytes, Caller]] = []
    owners: dict[str, str] = {}  # token hash -> the tenant it is listed under
    for name, spec in tenants.items():
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name == DEFAULT:
            raise ConfigError(where, f"tenant name {name!r}: letters, digits, '_', '.', '-', at most 63, not 'default'")
        if not isinstance(spec, dict) or not isinstance(spec.get("tokens", []), list):
            raise ConfigError(where, f"tenant {name}: needs `tokens: [...]`")
        topics = spec.get("completion_topics", [default_topic])
        if not isinstance(topics, list) or not all(isinstance(t, str) and t for t in topics):
            raise ConfigError(where, f"tenant {name}: completion_topics must be a list of topic names")
        tenant = Tenant(name, frozenset(topics))
        for entry in spec.get("tokens", []):
            m = _HASH.fullmatch(entry) if isinstance(entry, str) else None
            if m is None:
                raise ConfigError(where, f"tenant {name}: tokens are stored as 'sha256:<64 hex digits>', not in clear")
            digest = m.group(1)
            if digest in owners:
                if owners[digest] == name:
                    continue  # listed twice under one tenant: the same thing said twice
                # which tenant it spoke for would be decided by the file's order
                raise ConfigError(
                    where, f"token tok-{digest[:10]} is listed under tenants {owners[digest]} and {name}: one only"
                )
            owners[digest] = name
            out.append((bytes.fromhex(digest), Caller("tok-" + digest[:10], tenant, f"{name}:{digest}")))
    return out


class TenantAuth:
    """Bearer tokens to callers, compared in constant time; the tenants file re-read on change."""

    def __init__(
        self,
        tokens: list[str],
        tenants_file: str,
        default_topic: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        default = Tenant(DEFAULT, None)
        self._plain = [
            (d, Caller(token_id(t), default, f"{DEFAULT}:{d.hex()}"))
            for t in tokens
            for d in [hashlib.sha256(t.encode()).digest()]
        ]
        self._file, self._topic, self._clock = tenants_file, default_topic, clock
        self._from_file: list[tuple[bytes, Caller]] = []
        self._seen: tuple[float, int] | None = None  # the file's (mtime, size) last read
        self._checked = 0.0
        self._log = structlog.get_logger("reaper.http")
        if tenants_file:
            self.reload(strict=True)
        self.enabled = bool(tokens or tenants_file)

    @property
    def file(self) -> str:
        """The tenants file read ('' when there is none)."""
        return self._file

    def reload(self, *, strict: bool = False) -> None:
        """Read the tenants file again; a bad file keeps the tenants that were (strict: raise).
        Whatever the file holds, a reload never stops the server nor fails a request."""
        try:
            stat = os.stat(self._file)
            parsed = parse(read_text(self._file, "http.tenants_file"), self._topic)
            plain = {d for d, _ in self._plain}
            for digest, caller in parsed:
                if digest in plain:  # one token, two tenants: refused as two tenants in the file are
                    raise ConfigError(
                        "http.tenants_file",
                        f"token {caller.token} is a token of http.tokens (tenant default) and of tenant "
                        f"{caller.tenant.name}: one only",
                    )
        except (OSError, ConfigError) as exc:
            if strict:
                raise ConfigError("http.tenants_file", str(exc)) if isinstance(exc, OSError) else exc from None
            self._log.error("tenants file not reloaded: keeping the tenants already loaded", error=str(exc))
            return
        except Exception as exc:  # noqa: BLE001  (a file no check foresaw: say so, keep serving)
            if strict:
                raise ConfigError("http.tenants_file", f"cannot be read: {type(exc).__name__}") from None
            self._log.error("tenants file not reloaded: keeping the tenants already loaded", error=type(exc).__name__)
            return
        self._from_file, self._seen = parsed, (stat.st_mtime, stat.st_size)
        self._log.info(
            "tenants loaded", tenants=len({c.tenant.name for _, c in parsed}), tokens=len(parsed), file=self._file
        )

    def maybe_reload(self) -> None:
        """Re-read the file if it changed (looked at no more than once a second)."""
        if not self._file:
            return
        now = self._clock()
        if now - self._checked < 1.0:
            return
        self._checked = now
        try:
            stat = os.stat(self._file)
        except OSError:
            return
        if (stat.st_mtime, stat.st_size) != self._seen:
            self.reload()

    def identify(self, authorization: bytes | str | None) -> Caller | None:
        """The caller of a valid `Authorization: Bearer <token>` header, else None. The header's bytes
        as sent (UTF-8 for a token of the configuration, whose hash is of its UTF-8 bytes), or text."""
        if not self.enabled:
            return LOCAL
        if not authorization:
            return None
        header = authorization if isinstance(authorization, bytes) else authorization.encode("utf-8", "surrogateescape")
        scheme, _, credential = header.partition(b" ")
        if scheme.lower() != b"bearer" or not credential.strip():
            return None
        return self.identify_digest(hashlib.sha256(credential.strip()).digest())

    def identify_digest(self, digest: bytes) -> Caller | None:
        """The caller whose token has this SHA-256 digest (the console's sessions keep the digest)."""
        found = None
        for known, caller in (*self._plain, *self._from_file):  # every one compared: no early exit
            if hmac.compare_digest(known, digest):
                found = caller
        return found


async def own(store: Store, tenant: Tenant, batch_ids: list[int]) -> None:
    """Another tenant's batch answers as one that does not exist (the unknown-batch problem)."""
    owners = await store.owners(batch_ids)
    for batch_id in batch_ids:
        owner = owners.get(batch_id)
        if owner is not None and owner[0] != tenant.name:
            raise problems.from_tracker(UnknownBatch(batch_id), batch_in_path=True)


async def own_acked(store: Store, tenant: Tenant, ids: list[str], cpu: CpuThreads | None = None) -> None:
    """An ack naming another tenant's batch answers as if that batch did not exist. The entries are
    checked first (as the tracker checks them), and the batches in the order the tracker meets
    them, so no answer depends on whether another tenant's batch exists. A large ack is folded on
    `cpu`'s threads (create_app's), off the event loop."""
    try:
        if len(ids) <= 2000:
            fold(ids)
        else:
            await (cpu.run(fold, ids) if cpu is not None else asyncio.to_thread(fold, ids))
    except TrackerError as exc:
        raise problems.from_tracker(exc, batch_in_path=False) from None
    named: dict[int, int] = {}  # batch -> the position of the first entry naming it (ids are canonical)
    for position, entry in enumerate(ids):
        named.setdefault(int(entry.partition(":")[0]), position)
    owners = await store.owners(list(named))
    for batch_id in sorted(named, key=named.__getitem__):
        owner = owners.get(batch_id)
        if owner is None:
            return  # the tracker names this one first, whoever asks
        if owner[0] != tenant.name:  # expired or not: that it expired would tell that it exists
            raise problems.from_tracker(UnknownBatch(batch_id, ids[named[batch_id]]), batch_in_path=False)
        if owner[1] == "expired":
            return  # the tracker names this one first (the caller's own batch)
