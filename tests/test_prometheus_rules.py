"""Alert rules and the dashboard, checked with Debian's real Prometheus and promtool.

The test set-up installs Debian's `prometheus` package when it is missing
(deploy/prometheus/local.py); nothing here needs the reaper to run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.scripts import load_script

from harvester import metrics

REPO = Path(__file__).resolve().parents[1]
PROM_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "reaper.json"

# The metric names `reaper run` exports with the default prefix: operators' dashboards and alerts
# depend on them, so a rename must show up here. Histograms without their suffixes.
CONTRACT_METRICS = {
    "reaper_build_info",
    "reaper_inbox_processed_total",
    "reaper_inbox_deduplicated_total",
    "reaper_inbox_bytes",
    "reaper_inbox_ids",
    "reaper_inbox_oldest_age_seconds",
    "reaper_inbox_partitions_dropped_total",
    "reaper_inbox_maintenance_failures_total",
    "reaper_leader",
    "reaper_leader_acquisitions_total",
    "reaper_leader_fences_total",
    "reaper_leader_revocations_total",
    "reaper_leader_step_downs_total",
    "reaper_records_marked_total",
    "reaper_records_published_total",
    "reaper_records_purged_total",
    "reaper_records_reset_total",
    "reaper_records_dead_total",
    "reaper_produce_errors_total",
    "reaper_force_remarks_total",
    "reaper_mark_duration_seconds",
    "reaper_purge_duration_seconds",
    "reaper_produce_duration_seconds",
    "reaper_records_in_flight",
    "reaper_outbox_backlog_rows",
    "reaper_outbox_oldest_age_seconds",
    "reaper_batches",
    "reaper_items_pending",
    "reaper_acks_applied_total",
    "reaper_acks_duplicate_total",
    "reaper_acks_dead_lettered_total",
    "reaper_ack_apply_duration_seconds",
    "reaper_acker_lag_messages",
    "reaper_batches_completed_total",
    "reaper_batches_expired_total",
    "reaper_batches_opened_total",
    "reaper_batches_closed_total",
    "reaper_transaction_commit_duration_seconds",
    "reaper_transactions_aborted_total",
    "reaper_outbox_dead_rows",
    "reaper_outbox_requeued_rows",  # rows `reaper dead requeue` moved back
    # per harvest unit
    "reaper_unit_leader",
    "reaper_unit_records_marked_total",
    "reaper_unit_records_published_total",
    "reaper_unit_force_remarks_total",
    "reaper_unit_records_in_flight",
    # claims the settler found busy, the acker deferring locked batches
    "reaper_settle_busy_total",
    # when the settler and the sweeper last finished a pass (the console's overview)
    "reaper_settler_last_run_timestamp_seconds",
    "reaper_sweeper_last_run_timestamp_seconds",
    "reaper_acker_deferred_total",
    "reaper_acker_deferred_masks",
    # failures read from the ack topic (their acks count in reaper_acks_applied_total)
    "reaper_acker_failures_applied_total",
    # a mark the database refused as arriving or finishing after the lease ended
    "reaper_marks_refused_total",
    # marks not made because another configuration holds the outbox table (harvester.publishing.ownership)
    "reaper_outbox_claim_refusals_total",
}
HISTOGRAMS = {
    "reaper_mark_duration_seconds",
    "reaper_purge_duration_seconds",
    "reaper_produce_duration_seconds",
    "reaper_ack_apply_duration_seconds",
    "reaper_transaction_commit_duration_seconds",
}


def load_local():
    return load_script(PROM_DIR / "local.py", "deploy_prometheus_local", register=True)


local = load_local()


@pytest.fixture(scope="session")
def promtool() -> str:
    return local.ensure_installed()[1]


def dashboard_targets(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel."""
    board = json.loads(path.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def concrete(expr: str, job: str, window: str = "15s") -> str:
    """What Grafana sends: template variables replaced (`job` is a plain name: no regex escaping needed)."""
    assert re.fullmatch(r"[A-Za-z0-9_]+", job), job
    return expr.replace("$__rate_interval", window).replace("$job", job)


def metric_names(expr: str, prefix: str = "reaper", histograms: set[str] = HISTOGRAMS) -> set[str]:
    names = set()
    for name in re.findall(rf"\b{prefix}_[a-z_]+\b", expr):
        for suffix in ("_bucket", "_count", "_sum"):
            if name.endswith(suffix) and name[: -len(suffix)] in histograms:
                name = name[: -len(suffix)]
        names.add(name)
    return names


def rule_exprs(path: Path = PROM_DIR / "rules.yml") -> list[str]:
    rules = yaml.safe_load(path.read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "deploy" / "monitoring.py"), *args], capture_output=True, text=True, cwd="/"
    )


def test_the_reaper_exports_the_contract_metrics_by_default():
    # The names come from the collectors themselves, so the rules and the dashboard generated from
    # them cannot drift from what `reaper run` exports.
    assert set(metrics.names().values()) == CONTRACT_METRICS
    assert metrics.histograms() == HISTOGRAMS
    acme = metrics.names("acme")
    assert acme.keys() == metrics.names().keys()
    assert all(name.startswith("acme_") for name in acme.values()), acme


def test_the_committed_rules_and_dashboard_are_what_the_generator_writes():
    r = generate("--check")
    assert r.returncode == 0, r.stderr


def test_the_generator_check_notices_a_hand_edit(tmp_path):
    assert generate("--out", str(tmp_path)).returncode == 0
    assert generate("--check", "--out", str(tmp_path)).returncode == 0
    rules = tmp_path / "prometheus" / "rules.yml"
    rules.write_text(rules.read_text().replace("> 300", "> 600"))
    r = generate("--check", "--out", str(tmp_path))
    assert r.returncode == 1 and "rules.yml is out of date" in r.stderr


def test_another_prefix_yields_rules_and_panels_naming_only_its_metrics(promtool, tmp_path):
    r = generate("--prefix", "acme", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    known, histograms = set(metrics.names("acme").values()), metrics.histograms("acme")
    rules_file = tmp_path / "prometheus" / "rules.yml"
    board_file = tmp_path / "grafana" / "dashboards" / "reaper.json"
    assert "reaper_" not in rules_file.read_text() and "reaper_" not in board_file.read_text()
    exprs = rule_exprs(rules_file) + [expr for _title, expr in dashboard_targets(board_file)]
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr, "acme", histograms)
        assert names and names <= known, expr
        used |= names
    assert used == known
    doc = yaml.safe_load(rules_file.read_text())
    assert all(r["record"].startswith("job:acme_") for r in doc["groups"][0]["rules"])
    board = json.loads(board_file.read_text())
    job = next(v for v in board["templating"]["list"] if v["name"] == "job")
    assert job["query"]["query"] == "label_values(acme_build_info, job)"
    # promtool accepts them, and the alert unit tests (their series renamed) pass against them.
    r = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    tests = re.sub(r"\breaper_", "acme_", (PROM_DIR / "rules_test.yml").read_text())
    (rules_file.parent / "rules_test.yml").write_text(tests)
    r = subprocess.run(
        [promtool, "test", "rules", "rules_test.yml"], cwd=rules_file.parent, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_check_rules_accepts_every_rule(promtool):
    rules = yaml.safe_load((PROM_DIR / "rules.yml").read_text())
    count = sum(len(g["rules"]) for g in rules["groups"])
    r = subprocess.run([promtool, "check", "rules", str(PROM_DIR / "rules.yml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {count} rules found" in r.stdout


def test_alert_unit_tests_pass(promtool):
    r = subprocess.run([promtool, "test", "rules", "rules_test.yml"], cwd=PROM_DIR, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_alert_unit_tests_catch_a_wrong_threshold(promtool, tmp_path):
    # The unit tests must be able to fail: loosen one threshold and they do.
    rules = (PROM_DIR / "rules.yml").read_text()
    assert "reaper_outbox_oldest_age_seconds) > 300" in rules
    (tmp_path / "rules.yml").write_text(
        rules.replace("reaper_outbox_oldest_age_seconds) > 300", "reaper_outbox_oldest_age_seconds) > 600")
    )
    shutil.copy(PROM_DIR / "rules_test.yml", tmp_path)
    r = subprocess.run([promtool, "test", "rules", "rules_test.yml"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ReaperOutboxBacklogOld" in r.stdout + r.stderr


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load((PROM_DIR / "rules.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROM_DIR / "rules_test.yml").read_text())
    firing = {a["alertname"] for t in tests["tests"] for a in t.get("alert_rule_test", []) if a["exp_alerts"]}
    missing = alerts - firing - {"ReaperProduceErrors", "ReaperOutboxBacklogVeryOld"}
    assert not missing, f"alerts never shown firing in rules_test.yml: {sorted(missing)}"
    assert {
        "ReaperNoLeader",
        "ReaperOutboxBacklogOld",
        "ReaperResetsHigh",
        "ReaperAcksDeadLettered",
        "ReaperAckerLag",
        "ReaperBatchesExpired",
        "ReaperDeadRowsWaiting",
    } <= alerts


def test_dashboard_and_rules_use_only_contract_metrics_and_cover_them_all():
    used_by_board: set[str] = set()
    for title, expr in dashboard_targets():
        names = metric_names(expr)
        assert names, f"panel {title!r} queries no reaper metric: {expr}"
        assert names <= CONTRACT_METRICS, f"panel {title!r} uses unknown metrics {names - CONTRACT_METRICS}"
        used_by_board |= names
    assert used_by_board == CONTRACT_METRICS, f"metrics with no panel: {sorted(CONTRACT_METRICS - used_by_board)}"
    for expr in rule_exprs():
        assert metric_names(expr) <= CONTRACT_METRICS, expr


def test_dashboard_layout_is_sane():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in board["panels"] if p["type"] == "row"]
    assert titles == [
        "Overview",
        "Throughput",
        "Backlog",
        "Leadership",
        "Harvest units",
        "Failures",
        "Acks",
        "Batches",
        "Inbox",
    ]
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for dx in range(g["w"]):
            for dy in range(g["h"]):
                cell = (g["x"] + dx, g["y"] + dy)
                assert cell not in cells, f"panel {p['title']!r} overlaps another at {cell}"
                cells.add(cell)
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert [t["refId"] for t in p["targets"]] == [chr(65 + i) for i in range(len(p["targets"]))]


def test_real_prometheus_loads_the_rules_and_parses_every_panel_query():
    # Scrapes nothing that exists: this checks syntax and rule loading, not data
    # (tests/test_prometheus_live.py checks data against a running reaper).
    with local.LocalPrometheus([f"127.0.0.1:{local.free_port()}"], job="reaper") as prom:
        groups = prom.api("rules")["groups"]
        loaded = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        expected = yaml.safe_load((PROM_DIR / "rules.yml").read_text())
        names = {r.get("alert") or r.get("record") for g in expected["groups"] for r in g["rules"]}
        assert set(loaded) == names
        for _title, expr in dashboard_targets():
            prom.query(concrete(expr, "reaper"))  # raises PrometheusError on a parse error
        with pytest.raises(local.PrometheusError, match="parse error"):
            prom.query("sum(rate(reaper_records_published_total[1m])")
