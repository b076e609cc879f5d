"""The Grafana dashboard of outbox-reaper, as JSON: the rows and panels of deploy/grafana/panels.py
laid out on Grafana's 24-column grid, with stable ids, one datasource variable and a `$job`
selector. deploy/monitoring.py writes it to deploy/grafana/dashboards/reaper.json (default
prefix) or, with --prefix, for another prefix.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

from deploy.grafana.panels import rows
from harvester.metrics import names
from tracker.metrics import DEFAULT_PREFIX

DS = {"type": "prometheus", "uid": "${datasource}"}


def panel(pid: int, title: str, kind: str, unit: str, gridpos: dict, targets: list, description: str) -> dict:
    p = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": gridpos,
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": expr,
                "legendFormat": legend,
                "range": True,
                "instant": False,
            }
            for i, (expr, legend) in enumerate(targets)
        ],
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
    }
    if kind == "stat":
        p["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        }
        p["fieldConfig"]["defaults"]["color"] = {"mode": "thresholds"}
        p["fieldConfig"]["defaults"]["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
    else:
        p["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        }
        p["fieldConfig"]["defaults"]["custom"] = {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10,
            "showPoints": "never",
        }
    if title == "Leaders":
        p["fieldConfig"]["defaults"]["thresholds"]["steps"] = [
            {"color": "red", "value": None},
            {"color": "green", "value": 1},
            {"color": "orange", "value": 2},
        ]
    return p


def dashboard(prefix: str = DEFAULT_PREFIX) -> dict:
    m = SimpleNamespace(**names(prefix))
    panels, pid, y = [], 1, 0
    for row_title, row_panels in rows(prefix):
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        pid, y, x = pid + 1, y + 1, 0
        height = 4 if row_panels[0][1] == "stat" else 8
        for title, kind, unit, width, targets, description in row_panels:
            if x + width > 24:
                x, y = 0, y + height
            panels.append(
                panel(pid, title, kind, unit, {"h": height, "w": width, "x": x, "y": y}, targets, description)
            )
            pid, x = pid + 1, x + width
        y += height
    return {
        "uid": "outbox-reaper" if prefix == DEFAULT_PREFIX else f"outbox-reaper-{prefix}"[:40],
        "title": "outbox-reaper" if prefix == DEFAULT_PREFIX else f"outbox-reaper ({prefix})",
        "description": "Transactional-outbox harvester and fan-out tracker: throughput, backlog, leadership, failures, acks, batches.",
        "tags": ["outbox-reaper", "kafka", "postgres"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "options": [],
                },
                {
                    "name": "job",
                    "label": "Job",
                    "type": "query",
                    "datasource": DS,
                    "query": {"query": f"label_values({m.build_info}, job)", "refId": "job"},
                    "definition": f"label_values({m.build_info}, job)",
                    "refresh": 2,
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {},
                    "options": [],
                    "sort": 1,
                    "hide": 0,
                },
            ]
        },
        "panels": panels,
    }


def render(prefix: str = DEFAULT_PREFIX) -> str:
    return json.dumps(dashboard(prefix), indent=2) + "\n"
