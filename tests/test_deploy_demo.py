"""`make demo` runs green: a smaller fan-out through the same program, failover and completion shown.

Runs `python -m demo` as `make demo` does (against the already running local services, which
it must leave running), with 20,000 items to keep the suite short, and checks that its output
shows the leader killed, a standby taking over and the completion event, and that it removed
its schema, topics and processes afterwards.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_demo_shows_failover_and_completion_and_cleans_up(pg_dsn, kafka_bootstrap):
    r = subprocess.run(
        [sys.executable, "-m", "demo", "--items", "20000", "--kill-at", "0.1", "--keep-services", "--timeout", "240"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=360,
    )
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    run_id = re.search(r"schema demo_([0-9a-f]{8}) ready", out).group(1)
    assert re.search(r"SIGKILL -> reaper-\d \(pid \d+\), the leader", out), out
    killed = re.search(r"SIGKILL -> (reaper-\d)", out).group(1)
    took_over = re.search(r"(reaper-\d) took over as leader", out)
    assert took_over and took_over.group(1) != killed, out
    event = json.loads(out.split("completion event received on", 1)[1].splitlines()[1])
    assert event["total"] == 20000 and event["user_key"] == f"catalog-{run_id}"
    assert {"batch_id", "opened_at", "closed_at", "completed_at"} <= set(event)
    assert re.search(r"consumers processed [\d,]+ messages for 20,000 items", out), out
    assert re.search(r"demo finished in \d+\.\d+s", out)
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [f"demo_{run_id}"]).fetchone() is None
    left = [
        t
        for t in AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=15).topics
        if t.startswith(f"demo-{run_id}-")
    ]
    assert left == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"demo-{run_id}-items" not in ps  # no example consumer left behind
