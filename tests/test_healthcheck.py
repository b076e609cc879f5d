"""`reaper healthcheck` (the image's HEALTHCHECK) asks /healthz where the container's command
answers it: a `reaper serve` on http.port, the metrics server of `reaper run` on a changed
metrics.port, with the configuration file the container's main process was given. A fixed 9400
marked both unhealthy."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from support.harness import wait_until
from support.ports import free_port
from support.reaper import REPO, run_cli

from harvester.exit_codes import ExitCode
from harvester.health_server import HealthServer
from harvester.healthcheck import config_file_of_main_process


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    env.update(REAPER_LOGGING__FORMAT="json", **extra)
    return env


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_a_healthy_reaper_serve_is_healthy_on_its_http_port(pg_dsn, schema):
    port = free_port()
    env = _env(
        REAPER_DATABASE__DSN=pg_dsn,
        REAPER_DATABASE__SCHEMA=schema,
        REAPER_HTTP__PORT=str(port),
        REAPER_HTTP__LOCAL_MODE="true",  # no tokens: loopback only
        REAPER_METRICS__PORT=str(free_port()),  # the image's 9400 in a container: nothing listens on it
    )
    serve = subprocess.Popen(
        [sys.executable, "-m", "harvester.cli", "serve"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert wait_until(lambda: _answers(f"http://127.0.0.1:{port}/healthz"), 60), "reaper serve did not start"
        r = run_cli(["healthcheck"], env)
    finally:
        serve.terminate()
        serve.wait(30)
    assert r.returncode == ExitCode.OK, r.stderr
    assert f"http.port {port}" in r.stdout, r.stdout
    after = run_cli(["healthcheck"], env)  # stopped: unhealthy, naming where it asked
    assert after.returncode == 1 and f"127.0.0.1:{port}/healthz (http.port {port})" in after.stderr, after.stderr


def test_reaper_run_is_probed_on_the_metrics_port_its_configuration_file_names(tmp_path: Path):
    port = free_port()
    cfg = tmp_path / "reaper.yaml"
    cfg.write_text(f"metrics:\n  host: 0.0.0.0\n  port: {port}\n")
    cmdline = tmp_path / "cmdline"  # as /proc/1/cmdline reads for the image's `reaper -c FILE run`
    cmdline.write_bytes(
        b"\0".join([b"/usr/local/bin/python", b"/usr/local/bin/reaper", b"-c", str(cfg).encode(), b"run"])
    )
    assert config_file_of_main_process(cmdline) == str(cfg)
    server = HealthServer("0.0.0.0", port, lambda: (False, "kafka: down")).start()  # alive, not ready
    try:
        r = run_cli(["-c", str(cfg), "healthcheck"], _env(REAPER_HTTP__PORT=str(free_port())))
    finally:
        server.stop()
    assert r.returncode == ExitCode.OK and f"metrics.port {port}" in r.stdout, r.stdout + r.stderr


def test_the_main_process_file_is_read_only_from_a_reaper_command_line(tmp_path: Path):
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/bin/sh\0-c\0/etc/other\0")
    assert config_file_of_main_process(cmdline) is None
    cmdline.write_bytes(b"/sbin/docker-init\0--\0reaper\0--config=/etc/reaper/r.yaml\0serve\0")
    assert config_file_of_main_process(cmdline) == "/etc/reaper/r.yaml"
    assert config_file_of_main_process(tmp_path / "absent") is None


def test_a_bad_configuration_is_unhealthy_not_dockers_reserved_code():
    r = run_cli(["healthcheck"], _env(REAPER_METRICS__PORT="not-a-port"))
    assert r.returncode == 1 and "metrics.port" in r.stderr, r.stderr
