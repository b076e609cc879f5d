"""The console's session cookie is signed, not encrypted: it must not carry the token's SHA-256
digest, an offline guessing oracle for a token that outlives the session (a cookie left in a
browser, logged out or expired). It carries the digest sealed with the server's session key."""

from __future__ import annotations

import base64
import hashlib
import json

import httpx
from support.console import login
from support.http_server import TOKEN, RunningServer, http_config


def test_the_cookie_does_not_carry_the_tokens_digest_and_still_signs_the_user_in(pg_dsn, schema):
    digest = hashlib.sha256(TOKEN.encode()).digest()
    with RunningServer(http_config(pg_dsn, schema), [TOKEN]) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert login(c, TOKEN).status_code == 303
        cookie = c.cookies.get("reaper_console")
        raw = cookie.split(".")[0]
        body = json.loads(base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)))
        text = json.dumps(body)
        assert digest.hex() not in text and digest.hex()[:16] not in text
        assert base64.b64encode(digest).decode()[:16] not in text
        assert c.get("/console/batches").status_code == 200  # the session works as before
        assert len(bytes.fromhex(body["d"])) == 32
