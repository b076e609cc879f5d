"""Logging in to the console with an HTTP client, as a browser does: the login form's nonce cookie,
then the session cookie; and the CSRF token of a page's forms."""

from __future__ import annotations

import re

import httpx

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')
_CONFIRM = re.compile(r'name="confirm" value="([^"]+)"')


def login(client: httpx.Client, token: str) -> httpx.Response:
    form = client.get("/console/login")
    assert form.status_code == 200, form.text
    nonce = client.cookies.get("reaper_console_login")
    return client.post("/console/login", data={"token": token, "nonce": nonce, "next": "/console/"})


def csrf_of(page: httpx.Response) -> str:
    m = _CSRF.search(page.text)
    assert m, "no CSRF token on the page"
    return m.group(1)


def confirmation_of(page: httpx.Response) -> str:
    """The confirmation page's own token (an action is posted from the page that says what it does)."""
    m = _CONFIRM.search(page.text)
    assert m, "no confirmation token on the page"
    return m.group(1)
