"""Wrong bearer tokens are limited per client address, as the console's logins are (and with them):
only wrong tokens count; past 10 in a burst, a wrong token, or a right one never used from that
address, is refused with 429 until the bucket refills (one a second), so a guesser learns nothing;
a right token already used from the address goes on through, and other addresses are not held up."""

from __future__ import annotations

import httpx
from support.console import login
from support.http_server import TOKEN, RunningServer, http_config

OTHER = "another-right-token-0123456789abcdef"


def _get(c: httpx.Client, token: str | None, address: str) -> httpx.Response:
    headers = {"X-Forwarded-For": address}  # the test's proxy (127.0.0.1 is trusted) names the client
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return c.get("/v1/batches/1", headers=headers)


def test_guessing_tokens_is_as_slow_on_the_api_as_on_the_console_login(pg_dsn, schema):
    with (
        RunningServer(http_config(pg_dsn, schema), [TOKEN, OTHER]) as s,
        httpx.Client(base_url=s.url, timeout=30) as c,
    ):
        assert _get(c, TOKEN, "10.0.0.1").status_code == 404  # the right token: no such batch
        guesses = [_get(c, f"guess-{i:020d}", "10.0.0.1").status_code for i in range(30)]
        assert 401 in guesses and guesses[-1] == 429, guesses
        assert guesses.count(401) <= 12, guesses  # the burst (10), and what refilled meanwhile
        refused = _get(c, OTHER, "10.0.0.1")  # a right token new to the address tells nothing either
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1, refused.text
        assert refused.json()["type"].endswith(":rate-limited")
        assert _get(c, None, "10.0.0.1").status_code == 401  # no token is no guess
        assert _get(c, OTHER, "10.0.0.2").status_code == 404  # another address is not held up
        # one limit for both doors: the console's login from that address is refused too
        c.headers["X-Forwarded-For"] = "10.0.0.1"
        assert login(c, OTHER).status_code == 429


def test_a_token_already_used_from_the_address_gets_through_while_others_guess(pg_dsn, schema):
    """A client behind a shared address keeps sending a stale token: the right token that worked from
    there goes on working, on the API and at the console's login."""
    with (
        RunningServer(http_config(pg_dsn, schema), [TOKEN, OTHER]) as s,
        httpx.Client(base_url=s.url, timeout=30) as c,
    ):
        assert _get(c, TOKEN, "10.0.0.3").status_code == 404
        stale = [_get(c, f"stale-{i:020d}", "10.0.0.3").status_code for i in range(30)]
        assert stale[-1] == 429, stale
        assert [_get(c, TOKEN, "10.0.0.3").status_code for _ in range(5)] == [404] * 5
        assert _get(c, f"stale-{31:020d}", "10.0.0.3").status_code == 429  # the stale one is still held
        c.headers["X-Forwarded-For"] = "10.0.0.3"
        assert login(c, TOKEN).status_code == 303


def test_right_tokens_at_the_console_login_count_as_no_guess(pg_dsn, schema):
    """Operators signing in through one proxy leave its API clients alone: only wrong tokens count."""
    with RunningServer(http_config(pg_dsn, schema), [TOKEN, OTHER]) as s:
        for _ in range(15):  # each a browser of its own
            with httpx.Client(base_url=s.url, timeout=30, headers={"X-Forwarded-For": "10.0.0.4"}) as b:
                assert login(b, TOKEN).status_code == 303
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert _get(c, OTHER, "10.0.0.4").status_code == 404
