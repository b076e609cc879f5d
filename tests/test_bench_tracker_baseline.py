"""`python -m bench.tracker --baseline REF`: an earlier commit's tracker against the working tree's,
alternating in one run, on the real Postgres, at a tiny size (the figures mean nothing here; the
machinery is what is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import baseline

REPO = Path(__file__).resolve().parents[1]
EARLIER = "833fe98"  # a commit of main whose migrations differ from today's: each side migrates its own schema


def test_tracker_baseline_run_alternates_and_reports_both_figures(tmp_path: Path, pg_dsn: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUTBOX_TEST_DSN": pg_dsn, "OUTBOX_BENCH_BASELINES": str(tmp_path)}
    cmd = [sys.executable, "-m", "bench.tracker", "--baseline", EARLIER, "--pairs", "3", "--items", "1500"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    sha = baseline.resolve(EARLIER)
    b = last["baseline"]
    assert last["bench"] == "tracker" and last["items"] == b["items"] == 1500
    assert b["commit"] == sha and b["checkout"] == str(tmp_path / sha)
    assert b["order"] == ["new", "old", "old", "new", "new", "old"]
    assert [pair["first"] for pair in b["pairs"]] == ["new", "old", "new"]
    # Each side ran its own code: the working tree's, and the commit's checked-out copy.
    assert [r["code"] for r in b["runs"]["new"]] == [str(REPO)] * 3
    assert [r["code"] for r in b["runs"]["old"]] == [str(tmp_path / sha)] * 3
    for name in ("enqueue_items_per_s", "ack_acks_per_s"):
        f = b["figures"][name]
        assert len(f["ratios"]) == 3
        for ratio, new, old in zip(f["ratios"], b["runs"]["new"], b["runs"]["old"]):
            assert new[name] > 0 and old[name] > 0
            assert ratio == pytest.approx(new[name] / old[name], rel=1e-2)
        for key in ("ratio", "new", "old"):
            assert set(f[key]) == {"median", "min", "max", "spread"}
            assert f[key]["min"] <= f[key]["median"] <= f[key]["max"]
    # The pairs' own figure is the enqueue rate.
    assert [pair["ratio"] for pair in b["pairs"]] == b["figures"]["enqueue_items_per_s"]["ratios"]
    assert len(b["load_average_at_start"]) == 3 and len(b["load_average_at_end"]) == 3
    assert "pair 3/3: ratio new/old" in p.stderr


def test_tracker_baseline_refuses_what_it_cannot_run(pg_dsn: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OUTBOX_TEST_DSN": pg_dsn}
    for args, error in ((["--pairs", "0"], "--pairs must be at least 1"), (["--items", "0"], "--items must be")):
        cmd = [sys.executable, "-m", "bench.tracker", "--baseline", EARLIER, *args]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and error in p.stderr
    cmd = [sys.executable, "-m", "bench.tracker", "--baseline", "no-such-ref-anywhere", "--pairs", "1", "--items", "10"]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "not a commit" in p.stderr
