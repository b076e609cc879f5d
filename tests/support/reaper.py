"""Launch `reaper run` as a subprocess for failure tests, and read its JSON log lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .faults import ENV_VAR, FaultPlan

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """`reaper <args>` run to its end from the repository's root, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "harvester.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class ReaperProcess:
    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        *,
        faults: FaultPlan | None = None,
        extra_env: dict[str, str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        """`reaper run` with the tests' defaults and `env`; `command`: another command line that
        runs it (a script that changes one part of it first)."""
        full = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
        full.update(
            {
                "REAPER_ACKER__ENABLED": "false",
                "REAPER_SWEEPER__ENABLED": "false",
                "REAPER_METRICS__ENABLED": "false",
                "REAPER_LOGGING__FORMAT": "json",
                "REAPER_LOGGING__LEVEL": "info",
                "PYTHONUNBUFFERED": "1",
            }
        )
        full.update(env)
        full.update(extra_env or {})
        args = command or [sys.executable, "-m", "harvester.cli", "run"]
        if faults is not None:  # the product has no fault injection: a test entry point runs it
            full[ENV_VAR] = faults.to_json()
            args = [sys.executable, str(Path(__file__).with_name("faulty_reaper.py"))]
        self.log_path = log_path
        self._out = open(log_path, "wb")
        self.proc = subprocess.Popen(args, cwd=REPO, env=full, stdout=self._out, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def leader_ids(self) -> list[str]:
        return [e["leader_id"] for e in self.events() if e.get("event") == "neli leader"]

    def is_leader(self) -> bool:
        state = None
        for e in self.events():
            if e.get("event", "").startswith("neli "):
                state = e["event"][5:]
        return state == "leader"

    def wait_leader(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_leader():
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def terminate(self, timeout: float = 30) -> int:
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float = 30) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._out.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._out.close()


def stop_all(procs: list[ReaperProcess]) -> None:
    """Resume (if stopped) and terminate every reaper, killing what has not exited within 30 s."""
    for p in procs:
        p.signal(signal.SIGCONT)
        p.signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(30)
        except Exception:
            pass
        p.kill()
