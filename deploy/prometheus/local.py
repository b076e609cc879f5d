#!/usr/bin/env python3
"""A private Prometheus for tests and the demo, from Debian's `prometheus` package.

    python3 deploy/prometheus/local.py install          # apt-get install prometheus when missing
    python3 deploy/prometheus/local.py check            # promtool check rules + test rules
    python3 deploy/prometheus/local.py up --target 127.0.0.1:9400 [--port N]   # run until Ctrl-C

Debian's package registers a system service (on :9090 with /etc/prometheus); this never uses it:
each instance here has its own config, data folder under .local/prometheus/<name>/ and a free
port, and is stopped by whoever started it. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STATE = Path(os.environ.get("OUTBOX_LOCAL_DIR", REPO / ".local")).resolve() / "prometheus"
RULES = HERE / "rules.yml"
sys.path.insert(0, str(HERE.parent / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)

RULES_TEST = HERE / "rules_test.yml"


class PrometheusError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[prometheus] {msg}", flush=True)


def binaries() -> tuple[str, str] | None:
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    return (prom, tool) if prom and tool else None


def ensure_installed() -> tuple[str, str]:
    """Return the paths of `prometheus` and `promtool`, installing Debian's package if needed."""
    try:
        # One apt-get at a time per machine; parallel test workers wait and then find it installed.
        first_use.apt_install("prometheus", lambda: binaries() is not None, log=log)
    except first_use.FirstUseError as exc:
        raise PrometheusError(str(exc)) from None
    found = binaries()
    assert found is not None  # apt_install checked it
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def promtool(*args: str) -> subprocess.CompletedProcess:
    _, tool = ensure_installed()
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=120)


def scrape_config(job: str, targets: list[str], scrape_interval: str, rule_files: list[Path]) -> str:
    # JSON is YAML: no YAML library needed before the venv exists.
    return json.dumps(
        {
            "global": {
                "scrape_interval": scrape_interval,
                "evaluation_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}],
        },
        indent=2,
    )


class LocalPrometheus:
    """One private Prometheus process scraping the given targets."""

    def __init__(
        self,
        targets: list[str],
        *,
        job: str = "reaper",
        scrape_interval: str = "1s",
        rule_files: list[Path] | None = None,
        port: int | None = None,
        name: str | None = None,
    ) -> None:
        self.targets, self.job, self.scrape_interval = targets, job, scrape_interval
        self.rule_files = [RULES] if rule_files is None else rule_files
        self.port = port or free_port()
        self.dir = STATE / (name or f"run-{uuid.uuid4().hex[:8]}")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> LocalPrometheus:
        prom, _ = ensure_installed()
        shutil.rmtree(self.dir, ignore_errors=True)
        (self.dir / "data").mkdir(parents=True)
        config = self.dir / "prometheus.yml"
        config.write_text(scrape_config(self.job, self.targets, self.scrape_interval, self.rule_files))
        self.log = self.dir / "prometheus.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    prom,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.dir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"prometheus not ready on {self.url} within {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except (AttributeError, FileNotFoundError):
            return "(no log)"

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # a bad query answers 400 with a JSON error
            body = json.load(exc)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; returns the result vector (a list of {metric, value})."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def query_range(self, expr: str, seconds: float, step: str = "1s") -> list[dict]:
        end = time.time()
        return self.api("query_range", query=expr, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step=step)["result"]

    def targets_health(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalPrometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("install")
    sub.add_parser("check")
    up = sub.add_parser("up")
    up.add_argument("--target", action="append", required=True, help="host:port of a reaper metrics endpoint")
    up.add_argument("--port", type=int, default=9090)
    up.add_argument("--job", default="reaper")
    args = ap.parse_args(argv)
    try:
        if args.action == "install":
            prom, tool = ensure_installed()
            print(f"prometheus={prom}\npromtool={tool}")
        elif args.action == "check":
            for cmd in (["check", "rules", str(RULES)], ["test", "rules", str(RULES_TEST)]):
                r = promtool(*cmd)
                sys.stdout.write(r.stdout + r.stderr)
                if r.returncode != 0:
                    return r.returncode
        else:
            with LocalPrometheus(args.target, job=args.job, port=args.port, name="up") as p:
                log(f"scraping {', '.join(args.target)}; UI at {p.url} (Ctrl-C stops)")
                try:
                    p.proc.wait()
                except KeyboardInterrupt:
                    pass
    except PrometheusError as exc:
        print(f"[prometheus] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
