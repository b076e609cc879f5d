"""`python -m bench.harvest --baseline REF`: an earlier commit's harvester against the working tree's,
alternating in one run, on the real Postgres and Kafka, at a tiny size (the figures mean nothing
here; the machinery is what is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import baseline
from bench.baseline import pair_ratios
from bench.pairs import Command, CommandFailed, alternate, order

REPO = Path(__file__).resolve().parents[1]
# A commit of main from before harvest units (its harvester is harvester.mpr) and before most of
# today's migrations: the baseline must run its own code on a schema its own migrations made.
EARLIER = "7dffd89"


def test_pairs_alternate_which_side_goes_first() -> None:
    calls: list[str] = []
    figures = iter([10.0, 5.0, 4.0, 8.0, 9.0, 3.0])

    def side(name: str):
        def run() -> float:
            calls.append(name)
            return next(figures)

        return run

    after: list[int] = []
    r = alternate(side("new"), side("old"), 3, after_pair=lambda i: after.append(i) or i)
    assert calls == ["new", "old", "old", "new", "new", "old"] == r["order"]
    assert order(3) == [("new", "old"), ("old", "new"), ("new", "old")]
    assert [(p["first"], p["new"], p["old"], p["ratio"]) for p in r["pairs"]] == [
        ("new", 10.0, 5.0, 2.0),
        ("old", 8.0, 4.0, 2.0),
        ("new", 9.0, 3.0, 3.0),
    ]
    assert r["ratio"] == {"median": 2.0, "min": 2.0, "max": 3.0, "spread": 0.5}
    assert after == [0, 1, 2] and [p["after"] for p in r["pairs"]] == [0, 1, 2]
    assert len(r["load_average_at_start"]) == 3
    with pytest.raises(ValueError):
        alternate(side("new"), side("old"), 0)


def test_command_reads_the_last_line_and_says_why_it_failed() -> None:
    ok = Command("ok", [sys.executable, "-c", 'print(\'noise\'); print(\'{"x": 3, "code": "here"}\')'], "x")
    assert ok() == 3.0 and ok.runs[0]["x"] == 3
    wrong = Command("w", ok.argv, "x", expect={"code": "elsewhere"})
    with pytest.raises(CommandFailed, match="code is 'here', expected 'elsewhere'"):
        wrong()
    failing = Command("f", [sys.executable, "-c", "import sys; sys.exit('boom')"], "x")
    with pytest.raises(CommandFailed, match="boom"):
        failing()


def _checkout_in(cache: Path, ref: str) -> subprocess.Popen:
    code = f"from bench import baseline; from pathlib import Path; print(baseline.checkout({ref!r}, cache=Path({str(cache)!r})))"
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE
    )


def test_checkout_is_shared_by_concurrent_runs_and_rebuilt_after_an_interrupted_one(tmp_path: Path) -> None:
    sha = baseline.resolve(EARLIER)
    target = tmp_path / sha
    # What an interrupted creation leaves: its private folder, and (from code that wrote in place)
    # a target without its completion mark.
    (tmp_path / f".{sha}.partial-killed").mkdir()
    (tmp_path / f".{sha}.partial-killed" / "half").write_text("x")
    target.mkdir()
    (target / "half-written").write_text("x")
    procs = [_checkout_in(tmp_path, EARLIER) for _ in range(3)]
    outs = [p.communicate(timeout=60)[0].decode().strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outs == [str(target)] * 3
    assert (target / baseline.MARK).read_text().strip() == sha
    assert not (target / "half-written").exists()
    assert (target / "harvester" / "mpr.py").is_file()  # that commit's files, not today's
    assert not (target / "harvester" / "units.py").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([sha, f".{sha}.lock"])
    with pytest.raises(ValueError, match="not a commit"):
        baseline.resolve("no-such-ref-anywhere")


def test_baseline_run_alternates_and_reports_ratios_and_floor(
    tmp_path: Path, pg_dsn: str, kafka_bootstrap: str
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OUTBOX_TEST_DSN": pg_dsn,
        "KAFKA_BOOTSTRAP": kafka_bootstrap,
        "OUTBOX_BENCH_BASELINES": str(tmp_path),
    }
    cmd = [sys.executable, "-m", "bench.harvest", "--baseline", EARLIER, "--only", "throughput", "--pairs", "2"]
    p = subprocess.run([*cmd, "--rows", "2000"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    last = json.loads(p.stdout.strip().splitlines()[-1])
    sha = baseline.resolve(EARLIER)
    b = last["baseline"]
    assert b["commit"] == sha and b["rows"] == 2000 and b["checkout"] == str(tmp_path / sha)
    assert b["order"] == ["new", "old", "old", "new"]
    assert [pair["first"] for pair in b["pairs"]] == ["new", "old"]
    for pair in b["pairs"]:
        assert pair["new"] > 0 and pair["old"] > 0
        assert pair["ratio"] == pytest.approx(pair["new"] / pair["old"], rel=1e-2)
    for key in ("ratio", "new", "old"):
        assert set(b[key]) == {"median", "min", "max", "spread"}
        assert b[key]["min"] <= b[key]["median"] <= b[key]["max"]
    assert len(b["load_average_at_start"]) == 3
    # The rate and the CPU per record (the reaper's, the local Postgres server's, the machine's),
    # each compared pair by pair.
    cpu = ("cpu_us_per_record", "postgres_cpu_us_per_record", "machine_cpu_us_per_record")
    assert set(b["figures"]) == {"records_per_s", *cpu}
    assert b["figures"]["records_per_s"]["ratios"] == [pair["ratio"] for pair in b["pairs"]]
    for run in b["runs"]["new"] + b["runs"]["old"]:
        assert all(run[name] >= 0 for name in cpu)  # a short run's server CPU can be under a clock tick
        assert run["cpu_us_per_record"] > 0 and run["machine_cpu_us_per_record"] > 0
    for name in cpu:
        if any(o[name] == 0 for o in b["runs"]["old"]):
            assert b["figures"][name] is None
            continue
        assert b["figures"][name]["ratios"] == [
            round(n[name] / o[name], 3) for n, o in zip(b["runs"]["new"], b["runs"]["old"])
        ]
    # Each side ran its own code: the working tree's, and the commit's checked-out copy.
    assert [r["code"] for r in b["runs"]["new"]] == [str(REPO)] * 2
    assert [r["code"] for r in b["runs"]["old"]] == [str(tmp_path / sha)] * 2
    f = last["floor"]
    for key in ("sequential_per_s", "overlapped_per_s", "copy_per_s", "produce_per_s"):
        assert f[key]["median"] > 0
    assert f["overlapped_per_s"]["median"] >= f["sequential_per_s"]["median"]
    assert set(f["fraction"]) == {"new_of_sequential", "new_of_overlapped", "old_of_sequential", "old_of_overlapped"}
    # The keys of the plain throughput run are still there.
    assert last["benchmark"] == "harvest" and last["throughput"]["reaper"]["records_per_s"] > 0


def test_pair_ratios_leave_out_a_figure_a_run_lacks_or_a_baseline_run_reads_as_zero() -> None:
    new = [{"records_per_s": 30.0, "cpu": 2.0, "pg": 1.0}, {"records_per_s": 45.0, "cpu": 3.0, "pg": None}]
    old = [{"records_per_s": 20.0, "cpu": 4.0, "pg": 1.0}, {"records_per_s": 30.0, "cpu": 0.0, "pg": 2.0}]
    assert pair_ratios(new, old, "records_per_s", required=True) == [1.5, 1.5]
    assert pair_ratios(new, old, "cpu") is None  # a baseline run's CPU read 0 (below the clock's tick)
    assert pair_ratios(new, old, "pg") is None  # null in a run
    assert pair_ratios(new, old, "absent") is None
    assert pair_ratios(new[:1], old[:1], "cpu") == [0.5]
    assert pair_ratios([{"cpu": 0.0}], [{"cpu": 2.0}], "cpu") == [0.0]  # a zero on the new side is a ratio
    with pytest.raises(ValueError, match="records_per_s of a baseline run is 0"):
        pair_ratios(new, [{"records_per_s": 0}, {"records_per_s": 1.0}], "records_per_s", required=True)
    with pytest.raises(KeyError):
        pair_ratios(new, old, "absent", required=True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(min_value=0, max_value=1e6) | st.none(), st.floats(min_value=0, max_value=1e6) | st.none()),
        min_size=1,
        max_size=6,
    )
)
def test_pair_ratios_never_divide_by_zero_and_give_none_or_one_ratio_per_pair(pairs) -> None:
    new = [{"f": n} for n, _ in pairs]
    old = [{"f": o} for _, o in pairs]
    ratios = pair_ratios(new, old, "f")
    if any(n is None or o is None or o == 0 for n, o in pairs):
        assert ratios is None
    else:
        assert ratios == [round(n / o, 3) for n, o in pairs]
