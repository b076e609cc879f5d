"""A real Prometheus scraping a real `reaper run` under load; every dashboard panel returns data.

Debian's Prometheus (installed by the test set-up when missing) scrapes a `reaper run` subprocess
every second. The reaper works on this test's own schema and topics in the shared Postgres and
Kafka: an application batch is enqueued and published, consumed and acked through the ack topic
(with duplicates and a malformed ack that must be dead-lettered), and completes; an orphan batch
is expired by the sweeper. Then every expression of every panel of the Grafana dashboard is
sent to Prometheus' HTTP API as Grafana would send it, and each must return at least one finite
value.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from test_prometheus_rules import CONTRACT_METRICS, DASHBOARD, concrete, dashboard_targets, local

import tracker
from harvester import metrics
from tracker import outbox
from tracker.consumer import AckProducer, item_id_of

REPO = Path(__file__).resolve().parents[1]
ITEMS = 3000

# Metrics the tracker exports in the processes of consumers that use the inbox (tracker.inbox),
# not in the reaper's: their panels have data where those consumers are scraped
# (tests/test_inbox*.py check the counters themselves).
CONSUMER_SIDE = ("reaper_inbox_processed_total", "reaper_inbox_deduplicated_total")


def scrape(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return {}
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def wait_until(what: str, check, timeout: float, reaper: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if reaper.poll() is not None:
            pytest.fail(f"reaper exited with {reaper.returncode} while waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; reaper log:\n{log.read_text()[-4000:]}")


def prom_value(prom, expr: str) -> float:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else float("nan")


def reaper_env(pg_dsn: str, kafka_bootstrap: str, schema: str, t: dict[str, str], port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            "REAPER_DATABASE__DSN": pg_dsn,
            "REAPER_DATABASE__SCHEMA": schema,
            "REAPER_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap,
            "REAPER_HARVESTER__LEADER_TOPIC": t["leader"],
            "REAPER_HARVESTER__LEADER_GROUP": f"g-{t['leader']}",
            "REAPER_HARVESTER__SESSION_TIMEOUT": "6",
            "REAPER_HARVESTER__HEARTBEAT_TIMEOUT": "2",
            "REAPER_HARVESTER__DEFAULT_COMPLETION_TOPIC": t["done"],
            # Transactions on, so the commit-duration panel has data too (and that mode runs end to end).
            "REAPER_HARVESTER__TRANSACTIONAL_ID": f"t-{t['leader']}",
            "REAPER_ACKER__TOPIC": t["acks"],
            "REAPER_ACKER__GROUP": f"g-{t['acks']}",
            "REAPER_ACKER__DEAD_LETTER_TOPIC": t["dlq"],
            "REAPER_SWEEPER__INTERVAL": "1",
            "REAPER_SWEEPER__IDLE_EXPIRY": "600",
            "REAPER_METRICS__HOST": "127.0.0.1",
            "REAPER_METRICS__PORT": str(port),
            "REAPER_METRICS__BACKLOG_INTERVAL": "0.5",
            "REAPER_LOGGING__FORMAT": "json",
        }
    )
    return env


@pytest.mark.timeout(300)
def test_every_dashboard_panel_returns_data_from_a_running_reaper(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    t = {
        name: topics(f"live-{name}", partitions=p)
        for name, p in (("leader", 1), ("items", 2), ("acks", 2), ("dlq", 1), ("done", 1))
    }
    port = local.free_port()
    job = f"reaper_live_{uuid.uuid4().hex[:8]}"
    env = reaper_env(pg_dsn, kafka_bootstrap, schema, t, port)
    log = tmp_path / "reaper.log"
    # Prometheus first, so it sees every counter from zero.
    with local.LocalPrometheus([f"127.0.0.1:{port}"], job=job, scrape_interval="1s") as prom, open(log, "wb") as out:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "harvester.cli", "run"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_until("leadership", lambda: scrape(port).get("reaper_leader") == 1.0, 90, reaper, log)
            assert http_status(f"http://127.0.0.1:{port}/healthz") == 200
            assert http_status(f"http://127.0.0.1:{port}/readyz") == 200
            # A baseline: Prometheus has scraped the idle reaper (it applies new targets after a few
            # seconds), so the load below shows up as increases, not as a series born non-zero.
            wait_until(
                "Prometheus to scrape the idle leader",
                lambda: prom_value(prom, f'reaper_leader{{job="{job}"}}') == 1,
                60,
                reaper,
                log,
            )

            # The application: an orphan batch its producer abandoned an hour ago, and a real fan-out.
            with psycopg.connect(pg_dsn) as conn:
                orphan = tracker.open_batch(conn, user_key="orphan", completion_topic=t["done"], schema=schema)
                tracker.add_items(conn, orphan, 10, schema=schema)
                conn.execute(
                    sql.SQL("UPDATE {} SET last_activity_at = now() - interval '1 hour' WHERE id = %s").format(
                        sql.Identifier(schema, "batch")
                    ),
                    [orphan.id],
                )
                batch = tracker.open_batch(conn, user_key="live", completion_topic=t["done"], schema=schema)
                outbox.enqueue(conn, batch, (f'{{"n": {i}}}' for i in range(ITEMS)), topic=t["items"], schema=schema)
                tracker.close_batch(conn, batch, schema=schema)
                # A row Kafka can never accept (the items topic has 2 partitions): quarantined.
                conn.execute(
                    sql.SQL("INSERT INTO {} (topic, value, kafka_partition) VALUES (%s, 'x', 99)").format(
                        sql.Identifier(schema, "outbox")
                    ),
                    [t["items"]],
                )
                conn.commit()

            # Consumers: take every item from Kafka and ack it through the ack topic, with duplicates.
            consumer = Consumer(
                {
                    "bootstrap.servers": kafka_bootstrap,
                    "group.id": f"g-{t['items']}",
                    "auto.offset.reset": "earliest",
                    "enable.auto.commit": False,
                }
            )
            consumer.subscribe([t["items"]])
            ids: set[str] = set()
            deadline = time.monotonic() + 90
            while len(ids) < ITEMS and time.monotonic() < deadline:
                for msg in consumer.consume(1000, timeout=0.5):
                    if not msg.error():
                        ids.add(item_id_of(msg))
                assert reaper.poll() is None, log.read_text()[-4000:]
            consumer.close()
            assert len(ids) == ITEMS, f"consumed {len(ids)} of {ITEMS} items"
            ordered = sorted(ids)
            with AckProducer(bootstrap_servers=kafka_bootstrap, topic=t["acks"]) as acks:
                acks.ack(ordered[: ITEMS // 2])
                acks.flush()
                acks.ack(ordered[: ITEMS // 10])  # redelivered items, acked again
                acks.ack(ordered[ITEMS // 2 :])
            bad = Producer({"bootstrap.servers": kafka_bootstrap})
            bad.produce(t["acks"], key=b"1", value=b"not-an-item-id")
            assert bad.flush(30) == 0

            def complete() -> bool:
                with psycopg.connect(pg_dsn) as conn:
                    return tracker.status(conn, batch, schema=schema).state == "complete"

            wait_until("the batch to complete", complete, 90, reaper, log)

            # Prometheus has seen the whole story.
            def seen() -> bool:
                return (
                    prom_value(prom, f'reaper_batches_completed_total{{job="{job}"}}') >= 1
                    and prom_value(prom, f'reaper_acks_applied_total{{job="{job}"}}') >= ITEMS
                    and prom_value(prom, f'reaper_acks_dead_lettered_total{{job="{job}"}}') >= 1
                    and prom_value(prom, f'reaper_batches{{job="{job}", state="expired"}}') >= 1
                    and prom_value(prom, f'reaper_records_dead_total{{job="{job}"}}') >= 1
                    and prom_value(prom, f'reaper_outbox_backlog_rows{{job="{job}"}}') == 0
                )

            wait_until("Prometheus to scrape the results", seen, 60, reaper, log)
            # rate() and histogram_quantile() need two samples of a series inside the window: let a
            # few more scrapes land after the results.
            scrapes = f'count_over_time(reaper_build_info{{job="{job}"}}[5m])'
            enough = prom_value(prom, scrapes) + 3
            wait_until("three more scrapes", lambda: prom_value(prom, scrapes) >= enough, 30, reaper, log)
            assert [x["health"] for x in prom.targets_health()] == ["up"]

            # The dashboard's `job` variable, e.g. label_values(reaper_build_info, job), lists this job.
            board = json.loads(DASHBOARD.read_text())
            variable = next(v for v in board["templating"]["list"] if v["name"] == "job")
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["query"]["query"]).groups()
            assert job in prom.api(f"label/{label}/values", **{"match[]": metric})

            empty, nan = [], []
            for title, expr in dashboard_targets():
                if any(name in expr for name in CONSUMER_SIDE):
                    continue  # exported by the consumers' processes, not by the reaper scraped here
                result = prom.query(concrete(expr, job, window="2m"))
                values = [float(r["value"][1]) for r in result]
                if not values:
                    empty.append(f"{title}: {expr}")
                elif not any(math.isfinite(v) for v in values):
                    nan.append(f"{title}: {expr} -> {values}")
            assert not empty, "panels with no data:\n" + "\n".join(empty)
            assert not nan, "panels with only NaN:\n" + "\n".join(nan)

            # And the numbers mean what the panels say.
            assert prom_value(prom, f'sum(reaper_leader{{job="{job}"}})') == 1
            assert prom_value(prom, f'reaper_records_published_total{{job="{job}"}}') >= ITEMS + 1  # + completion
            assert prom_value(prom, f'reaper_acks_applied_total{{job="{job}"}}') == ITEMS
            assert prom_value(prom, f'reaper_acks_duplicate_total{{job="{job}"}}') >= ITEMS // 10
            assert prom_value(prom, f'reaper_batches_expired_total{{job="{job}"}}') >= 1
            assert prom_value(prom, f'reaper_records_dead_total{{job="{job}"}}') == 1
            with psycopg.connect(pg_dsn) as conn:
                dead = conn.execute(
                    sql.SQL("SELECT topic, kafka_partition FROM {}").format(sql.Identifier(schema, "outbox_dead"))
                ).fetchall()
            assert dead == [(t["items"], 99)]
            # The alert and recording rules evaluate cleanly against the real series. With a healthy
            # leader and an empty outbox, the alerts under way are the ones this test provoked: the
            # quarantined row (fires at once), the dead letter (pending: it fires only if dead
            # letters keep coming for 5 minutes), the expired orphan batch (fires at once) and the
            # row waiting in outbox_dead (pending for an hour); and, on a slow machine, the resets
            # of that row's retries before it was set aside (pending: a steady 1/s for 5 minutes).
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            assert prom_value(prom, f'job:reaper_leader:sum{{job="{job}"}}') == 1
            mine = {
                (a["labels"]["alertname"], a["state"])
                for a in prom.api("alerts")["alerts"]
                if a["labels"].get("job") == job
            }
            assert ("ReaperRowsQuarantined", "firing") in mine, mine
            assert mine <= {
                ("ReaperRowsQuarantined", "firing"),
                ("ReaperAcksDeadLettered", "pending"),
                ("ReaperBatchesExpired", "firing"),
                ("ReaperDeadRowsWaiting", "pending"),
                ("ReaperResetsHigh", "pending"),
            }, mine
            exported = {s["__name__"] for s in prom.api("series", **{"match[]": f'{{job="{job}"}}'})}
            missing = {
                m
                for m in CONTRACT_METRICS
                if m not in exported and f"{m}_bucket" not in exported and m not in CONSUMER_SIDE
            }
            assert not missing, f"metrics the reaper does not export: {sorted(missing)}"
        finally:
            if reaper.poll() is None:
                reaper.terminate()
                try:
                    reaper.wait(30)
                except subprocess.TimeoutExpired:
                    reaper.kill()
                    reaper.wait()


def families(port: int) -> set[str]:
    """Names of the metric families /metrics serves (counters without `_total`), with or without samples."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return set()
    return {fam.name for fam in text_string_to_metric_families(text)}


@pytest.mark.timeout(120)
def test_a_reaper_with_another_prefix_exports_every_metric_under_it(pg_dsn, kafka_bootstrap, schema, topics, tmp_path):
    # metrics.prefix renames every collector of the process: the harvester's, the acker's and its
    # tracker's, the claim settler's and the sweeper's. Nothing keeps the default name.
    t = {
        name: topics(f"prefix-{name}", partitions=p)
        for name, p in (("leader", 1), ("acks", 1), ("dlq", 1), ("done", 1))
    }
    port = local.free_port()
    env = reaper_env(pg_dsn, kafka_bootstrap, schema, t, port)
    env["REAPER_METRICS__PREFIX"] = "acme"
    expected = {name.removesuffix("_total") for name in metrics.names("acme").values()}
    log = tmp_path / "reaper.log"
    with open(log, "wb") as out:
        reaper = subprocess.Popen(
            [sys.executable, "-m", "harvester.cli", "run"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_until("the leader's metrics", lambda: scrape(port).get("acme_leader") == 1.0, 90, reaper, log)
            served = wait_until("every collector", lambda: (f := families(port)) >= expected and f, 30, reaper, log)
            ours = {
                name
                for name in served
                if not name.startswith(("python_", "process_"))  # prometheus_client's own collectors
                and name.removesuffix("_created") not in expected - {name}  # a counter's creation time
            }
            assert ours == expected, (sorted(ours - expected), sorted(expected - ours))
        finally:
            if reaper.poll() is None:
                reaper.terminate()
                try:
                    reaper.wait(30)
                except subprocess.TimeoutExpired:
                    reaper.kill()
                    reaper.wait()
