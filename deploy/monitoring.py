#!/usr/bin/env python3
"""Writes the Prometheus rules and the Grafana dashboard of outbox-reaper from its collectors.

    .venv/bin/python deploy/monitoring.py                        # rewrite deploy/'s files (prefix reaper)
    .venv/bin/python deploy/monitoring.py --check                # exit 1 if they are not what this writes
    .venv/bin/python deploy/monitoring.py --prefix acme --out DIR # for a reaper with metrics.prefix acme

Writes <out>/prometheus/rules.yml (deploy/prometheus/rules.py) and
<out>/grafana/dashboards/reaper.json (deploy/grafana/dashboard.py); every metric name in them is
read from the reaper's collectors (harvester.metrics.names) for the prefix. Run from anywhere: the
repository root is put on the import path.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

DEPLOY = Path(__file__).resolve().parent
sys.path.insert(0, str(DEPLOY.parent))

from tracker.metrics import DEFAULT_PREFIX, check_prefix  # noqa: E402  (after the path is set)

RULES = Path("prometheus") / "rules.yml"
DASHBOARD = Path("grafana") / "dashboards" / "reaper.json"


def load_module(name: str, path: Path) -> ModuleType:
    """A module of deploy/ (not a package) by its path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outputs(prefix: str = DEFAULT_PREFIX) -> dict[Path, str]:
    """Relative path under the output folder -> its text, for `prefix`."""
    check_prefix(prefix, "--prefix")
    rules = load_module("reaper_rules", DEPLOY / "prometheus" / "rules.py")
    dashboard = load_module("reaper_dashboard", DEPLOY / "grafana" / "dashboard.py")
    return {RULES: rules.render(prefix), DASHBOARD: dashboard.render(prefix)}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="the reaper's metrics.prefix (default %(default)s)")
    parser.add_argument("--out", type=Path, default=DEPLOY, help="folder to write into (default: deploy/)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    args = parser.parse_args(argv)
    try:
        files = outputs(args.prefix)
    except ValueError as exc:
        parser.error(str(exc))
    stale = []
    for rel, text in files.items():
        path = args.out / rel
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    for path in stale:
        print(f"{path} is out of date: run python3 deploy/monitoring.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
