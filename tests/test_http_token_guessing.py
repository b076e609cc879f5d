"""Wrong bearer tokens are limited per client address, as the console's logins are (and with them):
past 10 in a burst, every token from that address is refused with 429 until the bucket refills
(one a second), the right one too, so a guesser learns nothing; other addresses are not held up."""

from __future__ import annotations

import httpx
from support.console import login
from support.http_server import TOKEN, RunningServer, http_config


def _get(c: httpx.Client, token: str | None, address: str) -> httpx.Response:
    headers = {"X-Forwarded-For": address}  # the test's proxy (127.0.0.1 is trusted) names the client
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return c.get("/v1/batches/1", headers=headers)


def test_guessing_tokens_is_as_slow_on_the_api_as_on_the_console_login(pg_dsn, schema):
    with RunningServer(http_config(pg_dsn, schema), [TOKEN]) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        assert _get(c, TOKEN, "10.0.0.1").status_code == 404  # the right token: no such batch
        guesses = [_get(c, f"guess-{i:020d}", "10.0.0.1").status_code for i in range(30)]
        assert 401 in guesses and guesses[-1] == 429, guesses
        assert guesses.count(401) <= 12, guesses  # the burst (10), and what refilled meanwhile
        refused = _get(c, TOKEN, "10.0.0.1")  # the right token now tells nothing either
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
        assert refused.json()["type"].endswith(":rate-limited")
        assert _get(c, None, "10.0.0.1").status_code == 401  # no token is no guess
        assert _get(c, TOKEN, "10.0.0.2").status_code == 404  # another address is not held up
        # one limit for both doors: the console's login from that address is refused too
        c.headers["X-Forwarded-For"] = "10.0.0.1"
        assert login(c, TOKEN).status_code == 429
