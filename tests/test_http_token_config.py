"""Tokens the configuration names are ones a client can present, each speaking for one tenant: a
token a header cannot carry, or one hash listed under two tenants (or under a tenant and as a token
of http.tokens), is refused when loaded, naming the key and the token's id, never the token."""

from __future__ import annotations

import hashlib
import string

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.console import login
from support.http_server import TOKEN, RunningServer, http_config
from test_http_tenants import BILLING, SEARCH, _write

from harvester.config import ConfigError
from harvester.services.http.security import load_tokens
from harvester.services.http.tenants import TenantAuth, parse


def _hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


@given(
    st.text(alphabet=string.ascii_letters + string.digits, min_size=16, max_size=30),
    st.characters(min_codepoint=0x80, exclude_categories=("Zs", "Zl", "Zp", "Cs")),
)
def test_a_token_with_a_character_beyond_printable_ascii_is_refused_naming_its_key(tmp_path_factory, token, odd):
    bad = token[:8] + odd + token[8:]
    cfg = http_config("postgresql://x", "s", tokens=bad).http
    with pytest.raises(ConfigError, match=r"http\.tokens.*printable ASCII") as exc:
        load_tokens(cfg)
    assert bad not in str(exc.value)
    path = tmp_path_factory.mktemp("tokens") / "tokens"
    path.write_text(f"{token}\n{bad}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"http\.tokens_file"):
        load_tokens(http_config("postgresql://x", "s", tokens_file=str(path)).http)


def test_every_printable_ascii_token_the_server_takes_is_one_a_client_can_present(pg_dsn, schema):
    token = string.punctuation.replace(",", "").replace("#", "") + "Az09"  # every kind a header carries
    assert load_tokens(http_config(pg_dsn, schema, tokens=token).http) == [token]
    with RunningServer(http_config(pg_dsn, schema), [token]) as s:
        r = httpx.get(f"{s.url}/v1/batches/1", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 404, r.text  # known: no such batch


def test_a_token_hash_under_two_tenants_is_refused_naming_both():
    h = _hash("shared-token-0123456789abcdef")
    text = f"tenants:\n  billing:\n    tokens: ['{h}']\n  search:\n    tokens: ['{h}']\n"
    with pytest.raises(ConfigError, match="billing and search") as exc:
        parse(text, "done")
    assert exc.value.key == "http.tenants_file" and h[7:17] in str(exc.value)
    twice = f"tenants:\n  billing:\n    tokens: ['{h}', '{h}']\n"  # one tenant, said twice: harmless
    assert [c.tenant.name for _, c in parse(twice, "done")] == ["billing"]


def test_a_token_of_http_tokens_listed_under_a_tenant_is_refused_at_start_and_not_reloaded(tmp_path):
    tenants = tmp_path / "tenants.yaml"
    _write(tenants, {"billing": ([BILLING, TOKEN], None)})
    with pytest.raises(ConfigError, match="billing"):
        TenantAuth([TOKEN], str(tenants), "done")
    _write(tenants, {"billing": ([BILLING], None)})
    auth = TenantAuth([TOKEN], str(tenants), "done")
    _write(tenants, {"billing": ([BILLING], None), "search": ([SEARCH, TOKEN], None)})
    auth.reload()  # refused: the tenants that were stay
    caller = auth.identify(f"Bearer {TOKEN}")
    assert caller is not None and caller.tenant.name == "default"
    assert auth.identify(f"Bearer {SEARCH}") is None


def test_the_header_and_the_console_login_read_a_token_alike(pg_dsn, schema):
    """A token reaching the server by another way than the configuration's files (create_app's
    `tokens`) is compared as the bytes its client sends: UTF-8, as the console's login form reads it."""
    token = "pässwörd-0123456789abcdef"
    with RunningServer(http_config(pg_dsn, schema), [token]) as s, httpx.Client(base_url=s.url, timeout=30) as c:
        r = c.get("/v1/batches/1", headers={b"Authorization": b"Bearer " + token.encode("utf-8")})
        assert r.status_code == 404, r.text  # known: no such batch
        assert login(c, token).status_code == 303
