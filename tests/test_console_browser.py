"""The console in a real headless Chromium (Debian's chromium and chromium-driver, driven by
Selenium) against a real `reaper serve` app, two real `reaper run` processes, Postgres and Kafka:
logging in with the form, the overview naming the leader and then the next one after a SIGKILL,
a batch's progress bar moving as acks arrive until it shows completion, a requeue from the page
publishing the dead row once, and a viewer that cannot act. Screenshots of every page at 1280 and
390 pixels wide go to .local/artifacts/console/.

Chromium is installed on demand (deploy/console/browser.py); where it cannot be, these tests fail
under CI=true and are skipped elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from pathlib import Path

import psycopg
import pytest
from support.ci import skip_or_fail
from support.harness import Receiver, env_for, make_config, wait_until
from support.http_server import TOKEN, RunningServer
from support.ports import free_port
from support.reaper import ReaperProcess, stop_all
from support.scripts import load_script
from support.teardown import drop_schema
from test_admin import add_dead

import tracker

pytestmark = [pytest.mark.browser, pytest.mark.xdist_group("console-browser")]

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("OUTBOX_LOCAL_DIR", REPO / ".local")) / "artifacts" / "console"
VIEWER = "viewer-token-0123456789abcdef"
WIDTHS = {"laptop": (1280, 900), "phone": (390, 844)}
ZONE = "Asia/Kolkata"  # UTC+05:30 all year: local times differ from UTC on every page


def _installer():
    return load_script(REPO / "deploy" / "console" / "browser.py", "console_browser")


@pytest.fixture(scope="module")
def chromium():
    browser_mod = _installer()
    try:
        return browser_mod.ensure_installed()
    except browser_mod.BrowserError as exc:
        skip_or_fail(f"headless Chromium is not available: {exc}")


@pytest.fixture(scope="module")
def driver(chromium):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, chromedriver = chromium
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    service = Service(executable_path=chromedriver, env={**os.environ, "TZ": ZONE})
    d = webdriver.Chrome(service=service, options=options)
    d.implicitly_wait(0)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def stack(pg_dsn, kafka_bootstrap, tmp_path_factory):
    """A migrated schema, two `reaper run` processes (client ids reaper-a and reaper-b) and the console."""
    import uuid

    from confluent_kafka.admin import AdminClient, NewTopic

    from tracker import schema as schema_mod

    schema = f"t_{uuid.uuid4().hex[:12]}"
    schema_mod.migrate(pg_dsn, schema)
    leader_topic, data_topic = f"leader-{uuid.uuid4().hex[:8]}", f"data-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    for f in admin.create_topics([NewTopic(t, 1, 1) for t in (leader_topic, data_topic)]).values():
        f.result(30)
    ports = {"reaper-a": free_port(), "reaper-b": free_port()}
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=leader_topic,
        console={
            "viewer_tokens": VIEWER,
            "refresh_interval": 0.5,
            "kafka_timeout": 5,
            "metrics_urls": ",".join(f"http://127.0.0.1:{p}/metrics" for p in ports.values()),
        },
    )
    logs = tmp_path_factory.mktemp("reapers")
    reapers = {
        name: ReaperProcess(
            env_for(cfg),
            logs / f"{name}.log",
            extra_env={
                "REAPER_KAFKA__CONSUMER__CLIENT_ID": name,
                "REAPER_METRICS__ENABLED": "true",
                "REAPER_METRICS__HOST": "127.0.0.1",
                "REAPER_METRICS__PORT": str(port),
                "REAPER_SWEEPER__ENABLED": "true",
                "REAPER_SWEEPER__INTERVAL": "1",
            },
        )
        for name, port in ports.items()
    }
    try:
        assert wait_until(lambda: any(r.is_leader() for r in reapers.values()), 60), "no reaper became leader"
        with RunningServer(cfg, [TOKEN]) as server:
            yield {"cfg": cfg, "url": server.url, "reapers": reapers, "data_topic": data_topic, "schema": schema}
    finally:
        stop_all(list(reapers.values()))
        admin.delete_topics([leader_topic, data_topic])
        drop_schema(pg_dsn, schema)


def shoot(d, name: str) -> None:
    """Screenshots of the current page at both widths (the page is loaded again at each width)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for label, (w, h) in WIDTHS.items():
        d.set_window_size(w, h)
        d.refresh()
        wait_for(d, lambda: d.execute_script("return document.readyState") == "complete")
        d.save_screenshot(str(ARTIFACTS / f"{name}-{label}.png"))
    d.set_window_size(*WIDTHS["laptop"])


def wait_for(d, check, timeout: float = 30) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    stale = (StaleElementReferenceException,)
    WebDriverWait(d, timeout, poll_frequency=0.1, ignored_exceptions=stale).until(lambda _d: check())


def read(fn):
    """fn(), read again when a live update replaced the element it was reading."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(100):
        try:
            return fn()
        except StaleElementReferenceException:
            time.sleep(0.02)
    return fn()


def text(d) -> str:
    from selenium.webdriver.common.by import By

    return d.find_element(By.TAG_NAME, "body").text


def login(d, url: str, token: str) -> None:
    from selenium.webdriver.common.by import By

    # A page of the console with no script: the last test's page and its live refresh end before
    # its cookies (of this origin and path) go.
    d.get(url + "/console/static/console.css")
    d.delete_all_cookies()
    d.get(url + "/console/")
    wait_for(d, lambda: d.current_url.startswith(url + "/console/login"))
    d.find_element(By.ID, "token").send_keys(token)
    d.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    wait_for(d, lambda: "/console/login" not in d.current_url)


def test_login_and_the_overview_shows_the_leader_then_the_next_after_a_sigkill(driver, stack):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    d, url = driver, stack["url"]
    d.get(url + "/console/login")
    shoot(d, "login")
    login(d, url, TOKEN)
    assert d.current_url == url + "/console/"

    def leader() -> str:
        return d.find_element(By.CSS_SELECTOR, 'tr[data-unit="default"] td.leader').text

    wait_for(d, lambda: "reaper-" in leader())
    first = "reaper-a" if "reaper-a" in read(leader) else "reaper-b"
    wait_for(d, lambda: "Sweeper's last run\n-" not in text(d))  # read from the reapers' /metrics
    shoot(d, "overview")
    # Keyboard: the first Tab reaches the skip link, the next ones the pages.
    d.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)
    assert d.switch_to.active_element.text == "Skip to content"
    d.switch_to.active_element.send_keys(Keys.TAB)
    assert d.switch_to.active_element.text == "Overview"
    # Times: in the viewer's zone on the page, UTC in the title.
    shown, utc = read(
        lambda: (lambda t: (t.text, t.get_attribute("title")))(d.find_elements(By.CSS_SELECTOR, "time")[0])
    )
    assert utc.endswith(" UTC") and shown.endswith(" UTC+05:30") and shown[:16] != utc[:16], (shown, utc)

    stack["reapers"][first].kill()  # SIGKILL: no handover
    updated = read(lambda: d.find_element(By.ID, "overview").get_attribute("data-updated"))
    other = "reaper-b" if first == "reaper-a" else "reaper-a"
    wait_for(d, lambda: other in leader(), timeout=60)  # the live part, without a reload
    assert read(lambda: d.find_element(By.ID, "overview").get_attribute("data-updated")) != updated


def test_a_batch_progress_bar_moves_as_acks_arrive_and_shows_completion(driver, stack, pg_dsn):
    from selenium.webdriver.common.by import By

    d, url, schema = driver, stack["url"], stack["schema"]
    login(d, url, TOKEN)
    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, user_key="catalog-2026", schema=schema)
        tracker.add_items(conn, b, 10_000, schema=schema)
        tracker.close_batch(conn, b, schema=schema)
    d.get(url + "/console/batches")
    wait_for(d, lambda: f"{b.id}" in text(d))
    shoot(d, "batches")
    read(lambda: d.find_element(By.LINK_TEXT, str(b.id)).click())  # the list is live: found again if replaced
    wait_for(d, lambda: "0 acked, 10,000 pending of 10,000" in text(d))

    def bar() -> tuple[str, str]:
        el = d.find_element(By.CSS_SELECTOR, "#batch .progress")
        return el.get_attribute("data-acked"), d.find_element(By.CSS_SELECTOR, "#batch .progress .acked").get_attribute(
            "style"
        )

    assert read(bar)[0] == "0"
    with psycopg.connect(pg_dsn) as conn:
        tracker.ack(conn, [f"{b.id}:0:0-2999"], schema=schema, claims=False)
    wait_for(d, lambda: bar()[0] == "3000")  # polled, no reload
    assert "width: 30%" in read(bar)[1] and "3,000 acked, 7,000 pending" in text(d)
    shoot(d, "batch-in-progress")
    with psycopg.connect(pg_dsn) as conn:
        tracker.ack(conn, [f"{b.id}:0:3000-8191", f"{b.id}:1:0-1807"], schema=schema, claims=False)
    wait_for(d, lambda: d.find_element(By.CSS_SELECTOR, "[data-state]").text == "complete")
    assert "10,000 acked, 0 pending of 10,000" in text(d) and "Written to the outbox" in text(d)
    shoot(d, "batch-complete")


def test_a_requeue_from_the_page_publishes_the_dead_row_once(driver, stack, pg_dsn):
    from selenium.webdriver.common.by import By

    d, url, schema, topic = driver, stack["url"], stack["schema"], stack["data_topic"]
    [dead_id] = add_dead(pg_dsn, schema, topic, 1, "operator-test: partition gone", prefix="browser")
    receiver = Receiver(stack["cfg"].kafka.bootstrap_servers, topic)
    try:
        login(d, url, TOKEN)
        d.get(url + "/console/dead-acks")
        wait_for(d, lambda: "Dead-lettered acks" in text(d))
        shoot(d, "dead-acks")
        d.get(url + "/console/dead")
        shoot(d, "dead")
        d.find_element(By.LINK_TEXT, str(dead_id)).click()
        wait_for(d, lambda: "operator-test: partition gone" in text(d))
        shoot(d, "dead-row")
        d.find_element(By.LINK_TEXT, "Requeue…").click()
        wait_for(d, lambda: "Requeue 1 dead row?" in text(d))
        shoot(d, "requeue-confirm")
        d.find_element(By.ID, "confirm").click()
        wait_for(d, lambda: "requeued 1 rows" in text(d))
        assert wait_until(lambda: receiver.values() == [b"browser-1"], 30), receiver.values()
        time.sleep(1.0)  # a second copy would arrive by now
        assert receiver.values() == [b"browser-1"]
    finally:
        receiver.close()


def test_a_viewer_cannot_act(driver, stack, pg_dsn):
    from selenium.webdriver.common.by import By

    d, url, schema = driver, stack["url"], stack["schema"]
    with psycopg.connect(pg_dsn) as conn:
        b = tracker.open_batch(conn, schema=schema)
        tracker.add_items(conn, b, 5, schema=schema)
    [dead_id] = add_dead(pg_dsn, schema, "no-such-topic-here", 1, "viewer-test")
    login(d, url, VIEWER)
    d.get(f"{url}/console/batches/{b.id}")
    wait_for(d, lambda: f"Batch {b.id}" in text(d))
    assert "Expire" not in text(d) and "viewer" in text(d)
    d.get(url + "/console/dead")
    assert "Requeue" not in text(d)
    d.get(f"{url}/console/dead/requeue?id={dead_id}")  # an action's first step is refused too
    wait_for(d, lambda: "Refused" in text(d))
    assert "may only look" in text(d) and not d.find_elements(By.ID, "confirm")
    shoot(d, "viewer-refused")
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute(f'SELECT count(*) FROM "{schema}".outbox_dead WHERE id = %s', [dead_id]).fetchone()[0] == 1
        assert conn.execute(f'SELECT state FROM "{schema}".batch WHERE id = %s', [b.id]).fetchone()[0] == "open"
