"""`make caches` (deploy/local/caches.py): every download at once, each one's output whole, and a
failure named after every step has ended."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "local"))
import caches  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _step(name: str, code: str) -> caches.Step:
    return caches.Step(name, (sys.executable, "-c", code))


def test_the_steps_are_the_scripts_of_the_repository() -> None:
    todo = caches.steps("python3")
    assert len({s.name for s in todo}) == len(todo)
    assert {s.argv for s in todo} == {
        ("python3", "deploy/local/services.py", "fetch"),
        ("python3", "deploy/spark/jars.py"),
        ("python3", "tests/clients/node/install.py"),
        ("python3", "tests/clients/go/install.py"),
        ("python3", "tests/clients/jvm/install.py"),
        ("python3", "deploy/prometheus/local.py", "install"),
        ("python3", "deploy/console/browser.py", "install"),
    }
    for step in todo:
        assert (REPO / step.argv[1]).is_file(), step


def test_main_exits_1_naming_the_failed_steps_and_0_when_all_pass(capsys) -> None:
    assert caches.main([_step("fine", "pass"), _step("bad one", "raise SystemExit(2)")]) == 1
    err = capsys.readouterr().err
    assert "[caches] failed: bad one (each one's output is above)" in err, err
    assert "fine" not in err
    assert caches.main([_step("fine", "pass"), _step("also fine", "print('x')")]) == 0
    assert capsys.readouterr().err == ""


def test_a_sigterm_is_passed_on_to_every_step_still_running(tmp_path: Path) -> None:
    # The runner in a process of its own, with two steps that would run for a minute; each writes
    # its pid first.
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(REPO / 'deploy' / 'local')!r})\n"
        "import caches\n"
        'long = "import os, pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text(str(os.getpid())); time.sleep(60)"\n'
        f"pids = {str(tmp_path)!r}\n"
        "todo = [caches.Step(n, (sys.executable, '-c', long, f'{pids}/{n}.pid')) for n in ('a', 'b')]\n"
        "sys.exit(caches.main(todo))\n"
    )
    runner = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / "a.pid", tmp_path / "b.pid"]
    deadline = time.monotonic() + 30
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline and runner.poll() is None, runner.communicate()
        time.sleep(0.02)
    children = [int(p.read_text()) for p in pid_files]
    runner.send_signal(signal.SIGTERM)
    out, err = runner.communicate(timeout=30)
    assert runner.returncode == 1, (out, err)
    assert "[caches] failed: a, b " in err or "[caches] failed: b, a " in err, err
    assert "[caches] a: FAILED (exit status -15)" in out and "[caches] b: FAILED (exit status -15)" in out, out
    for pid in children:  # gone, not left running with the runner's parent
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_steps_run_side_by_side_not_one_after_the_other(tmp_path: Path) -> None:
    # Each waits until every one of them has started: run one after the other, none would finish.
    n = 4
    code = (
        "import pathlib, sys, time\n"
        f"d = pathlib.Path({str(tmp_path)!r}); (d / sys.argv[1]).touch()\n"
        "deadline = time.monotonic() + 20\n"
        f"while len(list(d.iterdir())) < {n}:\n"
        "    if time.monotonic() > deadline: sys.exit(3)\n"
        "    time.sleep(0.01)\n"
        "print('ready', sys.argv[1])\n"
    )
    todo = [caches.Step(f"s{i}", (sys.executable, "-c", code, f"s{i}")) for i in range(n)]
    out = io.StringIO()
    started = time.monotonic()
    assert caches.run_all(todo, cwd=tmp_path, out=out) == []
    assert time.monotonic() - started < 20
    text = out.getvalue()
    for i in range(n):
        assert f"ready s{i}\n[caches] s{i}: done in " in text, text


def test_a_failed_step_is_named_with_its_output_and_the_others_still_finish(tmp_path: Path) -> None:
    marker = tmp_path / "slow-finished"
    todo = [
        _step("broken", "import sys; print('no network'); sys.exit(5)"),
        _step("slow", f"import time, pathlib; time.sleep(0.5); pathlib.Path({str(marker)!r}).touch(); print('ok')"),
    ]
    out = io.StringIO()
    failed = caches.run_all(todo, cwd=tmp_path, out=out)
    assert [d.step.name for d in failed] == ["broken"]
    assert failed[0].returncode == 5
    assert marker.exists()  # the failure did not cut the other step short
    text = out.getvalue()
    assert "no network\n[caches] broken: FAILED (exit status 5) in " in text, text
    assert "ok\n[caches] slow: done in " in text, text


def test_a_step_that_cannot_start_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    todo = [caches.Step("missing", (str(tmp_path / "no-such-interpreter"), "x.py"))]
    failed = caches.run_all(todo, cwd=tmp_path, out=io.StringIO())
    assert [(d.step.name, d.returncode) for d in failed] == [("missing", 127)]


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3), max_size=5))
def test_exactly_the_steps_that_exit_non_zero_are_reported(codes: list[int]) -> None:
    todo = [_step(f"s{i}", f"import sys; sys.exit({c})") for i, c in enumerate(codes)]
    failed = caches.run_all(todo, cwd=REPO, out=io.StringIO())
    assert sorted(d.step.name for d in failed) == sorted(f"s{i}" for i, c in enumerate(codes) if c)
    assert all(d.returncode == codes[int(d.step.name[1:])] for d in failed)
