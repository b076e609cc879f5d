"""The console's plumbing: templates and their filters, the database pool, forms, the logged-in user."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup, escape
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from harvester.admin.common import duration
from harvester.config import Config
from harvester.db_liveness import with_liveness
from harvester.services.console.session import COOKIE, Sessions, User

T = TypeVar("T")
Ctx = dict[str, Any]  # a template's context: Pages.render's keywords
MAX_FORM_BYTES = 16 * 1024
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def _num(value: object) -> str:
    """Thousands separators: 1234567 -> 1,234,567."""
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"  # type: ignore[call-overload]


def _capped(value: int, cap: int) -> str:
    """A count made with LIMIT cap + 1: past the cap, "10,000+"."""
    return f"{cap:,}+" if value > cap else _num(value)


def _when(value: dt.datetime | float | None) -> Markup:
    """A <time> in UTC; console.js rewrites its text into the viewer's zone and keeps UTC in the title."""
    if value is None:
        return Markup("-")
    if isinstance(value, (int, float)):
        value = dt.datetime.fromtimestamp(value, dt.UTC)
    utc = value.astimezone(dt.UTC)
    text = utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    return Markup('<time datetime="{}" title="{}">{}</time>').format(utc.isoformat(), text, text)


def _dur(seconds: float | None) -> str:
    return "-" if seconds is None else duration(seconds)


def _age(value: dt.datetime | None, now: dt.datetime) -> str:
    return "-" if value is None else duration((now - value).total_seconds())


def _pct(part: int, total: int) -> str:
    return f"{100.0 * part / total:.2f}" if total else "0"


def _bytes_view(data: bytes | None) -> str:
    if data is None:
        return "(null)"
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + data.hex()


def link(path: str, **cursors: str | None) -> str:
    """`path` with the page cursors that are set as its query: a link that moves one cursor keeps
    the others where the reader left them."""
    query = {name: value for name, value in cursors.items() if value}
    return path + ("?" + urllib.parse.urlencode(query) if query else "")


def templates() -> Environment:
    env = Environment(
        loader=PackageLoader("harvester.services.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=_num, capped=_capped, when=_when, dur=_dur, age=_age, pct=_pct, bytes=_bytes_view)
    env.globals["quote"] = urllib.parse.quote
    env.globals["link"] = link
    return env


POOL_SIZE = 4  # the console's connections, and the threads that use them


class ConsoleUnavailable(Exception):
    """The database could not be reached or did not answer within http.request_timeout: a 503 page."""


class StillRunning(Exception):
    """An admin action was still running at the page's deadline: it goes on to its end in the
    console's thread (its audit line says how it ended)."""


class ActionStopped(Exception):
    """An admin action that had started failed on the database (what it committed before stays)."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(type(error).__name__)
        self.error = error


def _configure(timeout_ms: int) -> Callable[[psycopg.Connection], None]:
    def configure(conn: psycopg.Connection) -> None:
        # A statement or a lock wait past the deadline fails on the server, freeing its thread. Only
        # on a direct connection: a transaction pooler (PgBouncer) answers the backend pid itself,
        # and a session setting there would reach other clients' sessions; the page still answers
        # at its deadline (Db.run), its thread kept until the statement ends.
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
        if row is not None and row[0] == conn.info.backend_pid:
            setting = f"{timeout_ms}ms"
            conn.execute(
                "SELECT set_config('statement_timeout', %s, false), set_config('lock_timeout', %s, false)",
                [setting, setting],
            )
        conn.commit()

    return configure


class Db:
    """A small pool of the console's own; the admin functions are synchronous, so they run in the
    console's own threads (one per connection): a page waiting on the database never takes a
    thread the HTTP API needs. Each call answers within http.request_timeout, or ConsoleUnavailable."""

    def __init__(self, cfg: Config) -> None:
        self.timeout = cfg.http.request_timeout
        self.pool = ConnectionPool(
            with_liveness(cfg.database.dsn),
            min_size=0,  # no connection until someone opens a page: an API-only server pays nothing
            max_size=POOL_SIZE,
            open=False,
            name="reaper-console",
            kwargs={"application_name": "reaper-console", "prepare_threshold": None},
            configure=_configure(max(1, int(self.timeout * 1000))),
            timeout=self.timeout,
        )
        self.executor = ThreadPoolExecutor(POOL_SIZE, thread_name_prefix="reaper-console")
        # Kafka reads and scrapes (up to console.kafka_timeout): apart, so they never hold a page's thread
        self.others = ThreadPoolExecutor(2, thread_name_prefix="reaper-console-io")

    def open(self) -> None:
        self.pool.open()

    def close(self) -> None:
        self.pool.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.others.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[[psycopg.Connection], T]) -> T:
        def work() -> T:
            with self.pool.connection() as conn:
                return fn(conn)

        future = asyncio.get_running_loop().run_in_executor(self.executor, work)
        try:
            # the wait for a thread, for a connection and the statements together (as the API's calls)
            return await asyncio.wait_for(future, self.timeout)
        except (TimeoutError, PoolTimeout) as exc:
            raise ConsoleUnavailable("the database did not answer in time") from exc
        except psycopg.OperationalError as exc:  # unreachable, or a statement or lock timeout
            raise ConsoleUnavailable(type(exc).__name__) from None

    async def act(self, fn: Callable[[psycopg.Connection], T]) -> T:
        """An admin action: as run, but one already started is never abandoned as "unavailable". A
        thread cannot be stopped, and a requeue of many rows commits in chunks, so past the page's
        deadline the action goes on to its end and StillRunning says so; a database error once it
        has started is ActionStopped. ConsoleUnavailable only if it never started (and never will)."""
        lock = threading.Lock()
        state = {"started": False, "abandoned": False}

        def work() -> T:
            with self.pool.connection() as conn:
                with lock:
                    if state["abandoned"]:  # the page has already said it was not done
                        raise ConsoleUnavailable("abandoned before it started")
                    state["started"] = True
                return fn(conn)

        future = asyncio.get_running_loop().run_in_executor(self.executor, work)
        future.add_done_callback(_retrieve)  # one that outlives the page still ends quietly
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except TimeoutError:
            with lock:
                if not state["started"]:
                    state["abandoned"] = True
                    raise ConsoleUnavailable(
                        "the database did not answer in time; the action was not started"
                    ) from None
            raise StillRunning() from None
        except (PoolTimeout, ConsoleUnavailable) as exc:
            raise ConsoleUnavailable("the database did not answer in time; the action was not started") from exc
        except psycopg.Error as exc:
            if not state["started"]:  # the connection could not be made
                raise ConsoleUnavailable(type(exc).__name__) from None
            raise ActionStopped(exc) from exc

    async def thread(self, fn: Callable[[], T]) -> T:
        """`fn` (no database: Kafka, a metrics scrape) on the console's own threads."""
        return await asyncio.get_running_loop().run_in_executor(self.others, fn)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # the action's own audit line reports a failure


class Pages:
    """Renders pages and fragments with what every page shows (the user, the CSRF token)."""

    def __init__(self, cfg: Config, sessions: Sessions) -> None:
        self.env, self.cfg, self.sessions = templates(), cfg, sessions

    def render(self, request: Request, name: str, user: User | None, status: int = 200, **ctx: Any) -> Response:
        body = self.env.get_template(name).render(
            user=user,
            csrf=self.sessions.csrf(user) if user else "",
            auth=self.sessions.enabled,
            refresh_ms=int(self.cfg.console.refresh_interval * 1000),
            path=request.url.path,
            default_topic=self.cfg.harvester.default_completion_topic,
            **ctx,
        )
        return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)

    def message(self, request: Request, user: User | None, status: int, title: str, text: str) -> Response:
        return self.render(request, "message.html", user, status=status, title=title, text=text)


def current_user(request: Request, sessions: Sessions) -> User | None:
    return sessions.user(request.cookies.get(COOKIE))


FRAGMENTS = "/console/fragments/"


def to_login(request: Request) -> Response:
    """The login page for a page; a live fragment gets 401 instead, and console.js reloads its page.
    A fragment fetch that followed the redirect would load the login page behind the user's back
    and set its one-time login cookie, which could then disagree with the form the user fills."""
    if request.url.path.startswith(FRAGMENTS):
        return Response(
            "Signed out: reload the page.\n", status_code=401, media_type="text/plain", headers=SECURITY_HEADERS
        )
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(
        "/console/login?next=" + urllib.parse.quote(target, safe=""), status_code=303, headers=SECURITY_HEADERS
    )


async def read_form(request: Request) -> dict[str, str] | None:
    """A small urlencoded form's fields (the last of each name, as the pages' query strings are
    read), or None if it is not one."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/x-www-form-urlencoded":
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    try:
        pairs = urllib.parse.parse_qsl(body.decode("utf-8"), keep_blank_values=True, max_num_fields=50)
    except (UnicodeDecodeError, ValueError):
        return None
    return dict(pairs)


def safe_next(target: str | None) -> str:
    """Only a path of this console after login: never another site."""
    if target and target.startswith("/console/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/console/"


def escape_text(text: str) -> Markup:
    return escape(text)
