"""First-use downloads under concurrency and interruption (deploy/local/first_use.py and its users).

The model property: any number of processes populating one target at once, some of them killed at
any moment, leave either no target or a complete one; every survivor returns the complete one; it
is built at most once more than the number of builders killed. Then the real resolvers, from cold,
several processes at once and one interrupted: Kafka's jars, Spark's Kafka connector, the Node
client. They run the real mvn and npm against the registries (or the machine's Maven and npm
caches); without mvn or npm these tests fail.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "deploy" / "local"
sys.path.insert(0, str(LOCAL))
import first_use  # noqa: E402

FILES = 6

# A builder process: populate `target` with FILES files, slowly, logging each build it starts.
BUILDER = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, sys.argv[1])
    import first_use
    target, log, pause = sys.argv[2], sys.argv[3], float(sys.argv[4])
    FILES = int(sys.argv[5])

    def build(folder):
        with open(log, "a") as f:
            f.write(f"start {os.getpid()}\\n")
        for i in range(FILES):
            (folder / f"part-{i}").write_text(f"part {i}\\n" * 1000)
            time.sleep(pause)

    from pathlib import Path
    print(first_use.populate(Path(target), build))
    """
)


def _assert_complete(target: Path) -> None:
    assert first_use.is_complete(target)
    for i in range(FILES):
        assert (target / f"part-{i}").read_text() == f"part {i}\n" * 1000


def _partials(target: Path) -> list[Path]:
    return sorted(target.parent.glob(f".{target.name}.partial-*"))


def _builder(target: Path, log: Path, pause: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", BUILDER, str(LOCAL), str(target), str(log), str(pause), str(FILES)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    builders=st.integers(min_value=2, max_value=6),
    kills=st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 0.12)), max_size=4),
    pause=st.sampled_from([0.0, 0.005, 0.02]),
    seed=st.integers(0, 2**32 - 1),
)
def test_populate_builds_once_and_is_never_half_written(tmp_path_factory, builders, kills, pause, seed):
    root = tmp_path_factory.mktemp("cache")
    target, log = root / "thing" / "v1-abc", root / "builds.log"
    procs = [_builder(target, log, pause) for _ in range(builders)]
    killed: set[int] = set()
    started = time.monotonic()
    for index, delay in sorted(kills, key=lambda k: k[1]):
        index %= builders
        time.sleep(max(0.0, started + delay - time.monotonic()))
        # Whatever a reader sees at any moment is either nothing or the complete folder.
        if target.exists():
            _assert_complete(target)
        if procs[index].poll() is None:
            procs[index].send_signal(signal.SIGKILL)
            killed.add(index)
    outputs = {i: p.communicate(timeout=60) for i, p in enumerate(procs)}
    for i, p in enumerate(procs):
        if i in killed and p.returncode == -signal.SIGKILL:
            continue
        assert p.returncode == 0, outputs[i][1]
        assert outputs[i][0].strip() == str(target)
    real_kills = sum(procs[i].returncode == -signal.SIGKILL for i in killed)
    builds = log.read_text().count("start") if log.exists() else 0
    if real_kills < builders:
        _assert_complete(target)
        assert 1 <= builds <= real_kills + 1, f"{builds} builds for {real_kills} killed builders"
    else:
        assert not target.exists() or first_use.is_complete(target)
    # A later caller finds it (or builds it over the killed builders' leftovers), and cleans up.
    rng = random.Random(seed)
    again = _builder(target, log, rng.choice([0.0, 0.001]))
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    _assert_complete(target)
    if real_kills == builders:
        assert _partials(target) == []


def test_populate_rebuilds_an_unmarked_folder_and_cleans_up_after_a_failed_build(tmp_path):
    target = tmp_path / "jars" / "4.0.0-abc"
    target.mkdir(parents=True)
    (target / "half-written.jar").write_bytes(b"PK")  # what an older resolver left when killed

    def failing(folder: Path) -> None:
        (folder / "a.jar").write_bytes(b"x")
        raise OSError("network is down")

    with pytest.raises(OSError, match="network is down"):
        first_use.populate(target, failing)
    assert _partials(target) == [] and not first_use.is_complete(target)

    built: list[Path] = []
    first_use.populate(target, lambda folder: (built.append(folder), (folder / "b.jar").write_bytes(b"y")))
    assert len(built) == 1 and sorted(p.name for p in target.iterdir()) == [".complete", "b.jar"]
    first_use.populate(target, lambda folder: pytest.fail("a complete target is never built again"))


# ------------------------------------------------------------------ the real resolvers


def _resolvers() -> dict[str, tuple[list[str], str]]:
    """name -> (command, the environment variable that moves its cache)."""
    venv_python = REPO / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    return {
        "kafka-jars": ([sys.executable, str(LOCAL / "services.py"), "fetch"], "OUTBOX_KAFKA_LIB_CACHE"),
        "spark-connector": ([python, str(REPO / "deploy" / "spark" / "jars.py")], "OUTBOX_SPARK_JARS_CACHE"),
        "node-client": (
            [sys.executable, str(REPO / "tests" / "clients" / "node" / "install.py")],
            "OUTBOX_NODE_CLIENT_CACHE",
        ),
    }


def _start(name: str, cache: Path) -> subprocess.Popen:
    cmd, variable = _resolvers()[name]
    env = {**os.environ, variable: str(cache)}
    # A session of its own, so an interruption reaches mvn or npm too, as Ctrl-C or a CI timeout would.
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{err}"
    return out.strip().splitlines()[-1]  # what it resolved (log lines may come before)


def _complete_folders(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]


@pytest.mark.parametrize("name", ["kafka-jars", "spark-connector", "node-client"])
def test_resolver_from_cold_with_three_processes_at_once(tmp_path, name):
    cache = tmp_path / name
    procs = [_start(name, cache) for _ in range(3)]
    outputs = [_finish(p) for p in procs]
    assert len(set(outputs)) == 1, outputs
    folders = _complete_folders(cache)
    assert len(folders) == 1 and first_use.is_complete(folders[0]), folders
    assert not list(cache.glob(".*.partial-*")), "a partial folder was left behind"


@pytest.mark.parametrize("name", ["kafka-jars", "spark-connector", "node-client"])
def test_resolver_killed_midway_leaves_nothing_that_looks_usable(tmp_path, name):
    cache = tmp_path / name
    proc = _start(name, cache)
    deadline = time.monotonic() + 120
    # Kill it once it is building (its private folder exists), before it finished.
    while time.monotonic() < deadline and proc.poll() is None and not list(cache.glob(".*.partial-*")):
        time.sleep(0.02)
    if proc.poll() is None:
        time.sleep(random.uniform(0.0, 0.5))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for folder in _complete_folders(cache) if cache.exists() else []:
        # Only a resolver that finished before the kill may have left a folder, and then a complete one.
        assert first_use.is_complete(folder), f"{folder} is there without its completion mark"
    out = _finish(_start(name, cache))
    folders = _complete_folders(cache)
    assert len(folders) == 1 and first_use.is_complete(folders[0]) and str(folders[0]) in out
    assert not list(cache.glob(".*.partial-*"))
