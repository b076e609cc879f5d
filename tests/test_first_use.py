"""First-use downloads under concurrency and interruption (deploy/local/first_use.py and its users).

The model property: any number of processes populating one target at once, some of them killed at
any moment, leave either no target or a complete one; every survivor returns the complete one; it
is built at most once more than the number of builders killed. Then the real resolvers, from cold,
several processes at once and one interrupted: Kafka's jars, Spark's Kafka connector, the Node
client, the JDBC driver. They run the real mvn and npm against the registries (or the machine's
Maven and npm caches); without mvn or npm these tests fail. The Go client is Go's own module
cache, checked the same way (two at once from empty caches, after one killed midway).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "deploy" / "local"
sys.path.insert(0, str(LOCAL))
import first_use  # noqa: E402

FILES = 6

# A builder process: populate `target` with FILES files, slowly, logging each build it starts.
BUILDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import first_use
    target, log, pause, files = sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])

    def build(folder, pass_fds):
        with open(log, "a") as f:
            f.write(f"start {os.getpid()}\\n")
        for i in range(files):
            (folder / f"part-{i}").write_text(f"part {i}\\n" * 1000)
            time.sleep(pause)

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


def _started(log: Path) -> list[int]:
    try:
        return [int(line.split()[1]) for line in log.read_text().splitlines()]
    except FileNotFoundError:
        return []


class _Watcher(threading.Thread):
    """Looks at the target as often as it can while builders run: it is absent or complete."""

    def __init__(self, target: Path) -> None:
        super().__init__(daemon=True)
        self.target, self.stop, self.seen, self.failure = target, threading.Event(), 0, None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.target.exists():
                    _assert_complete(self.target)
                    self.seen += 1
            except AssertionError as exc:
                self.failure = exc
                return
            time.sleep(0.001)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    builders=st.integers(min_value=2, max_value=5),
    # ("building", d): kill whoever is building, d seconds into its build; ("any", d): kill the
    # i-th builder d seconds after the start, building or waiting for the lock.
    kills=st.lists(st.tuples(st.sampled_from(["building", "any"]), st.integers(0, 4), st.floats(0.0, 0.1)), max_size=3),
    pause=st.sampled_from([0.005, 0.02]),
)
def test_populate_builds_once_and_is_never_half_written(tmp_path_factory, builders, kills, pause):
    root = tmp_path_factory.mktemp("cache")
    target, log = root / "thing" / "v1-abc", root / "builds.log"
    watcher = _Watcher(target)
    watcher.start()
    procs = [_builder(target, log, pause) for _ in range(builders)]
    by_pid = {p.pid: p for p in procs}
    killed: set[int] = set()
    started = time.monotonic()
    for kind, index, delay in kills:
        if kind == "building":
            # the newest build still running, once there is one (at most 10 s of waiting)
            deadline, victim = time.monotonic() + 10, None
            while victim is None and time.monotonic() < deadline and any(p.poll() is None for p in procs):
                running = [pid for pid in _started(log) if pid not in killed and by_pid[pid].poll() is None]
                victim = by_pid[running[-1]] if running else None
                if victim is None:
                    time.sleep(0.002)
            if victim is None:
                continue
            time.sleep(delay)
        else:
            victim = procs[index % builders]
            time.sleep(max(0.0, started + delay - time.monotonic()))
        if victim.poll() is None:
            victim.send_signal(signal.SIGKILL)
            killed.add(victim.pid)
    outputs = {p.pid: p.communicate(timeout=60) for p in procs}
    watcher.stop.set()
    watcher.join()
    assert watcher.failure is None, f"a reader saw a half-written target: {watcher.failure}"
    really_killed = {p.pid for p in procs if p.returncode == -signal.SIGKILL}
    for p in procs:
        if p.pid not in really_killed:
            assert p.returncode == 0, outputs[p.pid][1]
            assert outputs[p.pid][0].strip() == str(target)
    builds = _started(log)
    if len(really_killed) < builders:
        _assert_complete(target)
        assert 1 <= len(builds) <= len(really_killed) + 1, f"{len(builds)} builds, {len(really_killed)} killed"
        # every build but the last was a builder killed midway
        assert set(builds[:-1]) <= really_killed
    # A later caller finds it (or builds it over the killed builders' leftovers) and cleans up.
    again = _builder(target, log, 0.0)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    _assert_complete(target)
    if len(really_killed) == builders:
        assert _partials(target) == []


def test_a_killed_builders_child_keeps_the_next_builder_waiting(tmp_path):
    """A builder killed while its download tool still runs: the lock lives on in the tool, so the
    next builder starts only after the tool has ended, not over its writes."""
    target, marks = tmp_path / "cache" / "v1", tmp_path / "marks"
    marks.mkdir()
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from pathlib import Path
        sys.path.insert(0, sys.argv[1])
        import first_use
        marks = Path(sys.argv[3])
        child = "import time, pathlib, sys; time.sleep(1.5); pathlib.Path(sys.argv[1], 'child-ended').write_text(str(time.time()))"

        def build(folder, pass_fds):
            if not (marks / "first").exists():
                (marks / "first").write_text("")
                subprocess.Popen([sys.executable, "-c", child, str(marks)], pass_fds=pass_fds)
                (marks / "child-started").write_text("")
                time.sleep(60)  # killed here, its child still running
            (marks / "second-started").write_text(str(time.time()))

        first_use.populate(Path(sys.argv[2]), build)
        """
    )
    first = subprocess.Popen([sys.executable, "-c", script, str(LOCAL), str(target), str(marks)])
    deadline = time.monotonic() + 10
    # Killed once its child runs (not at "first": under load the kill could land before the spawn).
    while not (marks / "child-started").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    first.kill()  # the builder alone, as the OOM killer would
    first.wait()
    second = subprocess.run([sys.executable, "-c", script, str(LOCAL), str(target), str(marks)], timeout=60)
    assert second.returncode == 0
    assert float((marks / "second-started").read_text()) >= float((marks / "child-ended").read_text())
    assert first_use.is_complete(target)


def test_apt_install_asks_whether_a_package_is_present_only_under_the_apt_lock():
    # While another process's apt-get runs, a command can be unpacked before dpkg has configured
    # its package: asked then, present() would answer too early.
    asked: list[float] = []

    def present() -> bool:
        asked.append(time.monotonic())
        return True

    with first_use.machine_lock("apt"):
        installer = threading.Thread(target=first_use.apt_install, args=("not-installed-here", present))
        installer.start()
        installer.join(0.5)
        assert installer.is_alive() and not asked
        released = time.monotonic()
    installer.join(10)
    assert not installer.is_alive()
    assert len(asked) == 1 and asked[0] >= released


def test_populate_rebuilds_an_unmarked_folder_and_cleans_up_after_a_failed_build(tmp_path):
    target = tmp_path / "jars" / "4.0.0-abc"
    target.mkdir(parents=True)
    (target / "half-written.jar").write_bytes(b"PK")  # what an older resolver left when killed

    def failing(folder: Path, _fds: tuple[int, ...]) -> None:
        (folder / "a.jar").write_bytes(b"x")
        raise OSError("network is down")

    with pytest.raises(OSError, match="network is down"):
        first_use.populate(target, failing)
    assert _partials(target) == [] and not first_use.is_complete(target)

    built: list[Path] = []

    def good(folder: Path, _fds: tuple[int, ...]) -> None:
        built.append(folder)
        (folder / "b.jar").write_bytes(b"y")

    first_use.populate(target, good)
    assert len(built) == 1 and sorted(p.name for p in target.iterdir()) == [".complete", "b.jar"]
    first_use.populate(target, lambda folder, fds: pytest.fail("a complete target is never built again"))
    # An unmarked folder its caller can vouch for is adopted, not rebuilt.
    other = tmp_path / "jars" / "old"
    other.mkdir()
    (other / "whole.jar").write_bytes(b"z")
    first_use.populate(other, lambda folder, fds: pytest.fail("adopted"), adopt=lambda d: (d / "whole.jar").exists())
    assert first_use.is_complete(other) and (other / "whole.jar").read_bytes() == b"z"


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
        "jdbc-client": (
            [sys.executable, str(REPO / "tests" / "clients" / "jvm" / "install.py")],
            "OUTBOX_JDBC_CLIENT_CACHE",
        ),
    }


def _start(name: str, cache: Path, *, cold_tools: Path | None = None) -> subprocess.Popen:
    """Start a resolver with its cache at `cache`; `cold_tools`: empty Maven and npm caches there too."""
    cmd, variable = _resolvers()[name]
    env = {**os.environ, variable: str(cache)}
    if cold_tools is not None:
        env["MAVEN_OPTS"] = f"{env.get('MAVEN_OPTS', '')} -Dmaven.repo.local={cold_tools / 'm2'}"
        env["npm_config_cache"] = str(cold_tools / "npm")
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kafka-jars", "spark-connector", "node-client", "jdbc-client"])
def test_resolver_from_cold_with_three_processes_at_once(tmp_path, name):
    """Truly cold: the project's cache and Maven's and npm's are empty, so this downloads."""
    cache = tmp_path / name
    procs = [_start(name, cache, cold_tools=tmp_path / "tools") for _ in range(3)]
    outputs = [_finish(p) for p in procs]
    assert len(set(outputs)) == 1, outputs
    folders = _complete_folders(cache)
    assert len(folders) == 1 and first_use.is_complete(folders[0]), folders
    assert not list(cache.glob(".*.partial-*")), "a partial folder was left behind"


@pytest.mark.parametrize("name", ["kafka-jars", "spark-connector", "node-client", "jdbc-client"])
def test_resolver_killed_midway_leaves_nothing_that_looks_usable(tmp_path, name):
    cache = tmp_path / name
    proc = _start(name, cache)
    deadline = time.monotonic() + 300
    # Kill the resolver and its tool once the tool has written something into its private folder.
    written = False
    while time.monotonic() < deadline and proc.poll() is None and not written:
        written = any(f.is_file() for partial in cache.glob(".*.partial-*") for f in partial.rglob("*"))
        time.sleep(0.005)
    assert written, f"the resolver ended before writing anything: {proc.communicate()}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _complete_folders(cache) == [], "a killed resolver left a folder where the cache goes"
    out = _finish(_start(name, cache))
    folders = _complete_folders(cache)
    assert len(folders) == 1 and first_use.is_complete(folders[0]) and str(folders[0]) in out
    assert not list(cache.glob(".*.partial-*"))


@pytest.mark.slow
def test_go_client_killed_midway_then_two_at_once_from_an_empty_module_cache(tmp_path):
    """tests/clients/go/install.py relies on Go's module cache being safe under concurrency and
    interruption: one killed while it downloads, then two at once, both succeed and the module
    cache verifies against the checked-in go.sum. The machine's build cache is kept: with
    -trimpath, what it compiled once is found again whatever the module cache's folder (a build
    from an empty build cache takes minutes)."""
    install = [sys.executable, str(REPO / "tests" / "clients" / "go" / "install.py")]
    env = {**os.environ, "GOMODCACHE": str(tmp_path / "mod")}
    # -modcacherw: a module cache that tmp_path's removal can delete
    env["GOFLAGS"] = f"{env.get('GOFLAGS', '')} -modcacherw -trimpath".strip()
    first = subprocess.Popen(install, env=env, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None and not (tmp_path / "mod" / "cache").exists():
        time.sleep(0.005)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    procs = [
        subprocess.Popen(install, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    go = [_finish(proc) for proc in procs][0]  # the go command install.py used
    verify = subprocess.run(
        [go, "mod", "verify"],
        cwd=REPO / "tests" / "clients" / "go",
        # tests/clients/go/toolchain.py says how to run the go command install.py chose
        env=load_script(REPO / "tests" / "clients" / "go" / "toolchain.py", "go_toolchain").environment(go, env),
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0 and "all modules verified" in verify.stdout, verify.stdout + verify.stderr


def test_sudo_asks_for_a_password_naming_the_package_it_installs(monkeypatch):
    monkeypatch.setattr(first_use.os, "geteuid", lambda: 1000)
    prefix = first_use.sudo_prefix("maven")
    assert prefix[:2] == ["sudo", "-p"] and "install Debian's maven" in prefix[2] and "%u" in prefix[2]
    monkeypatch.setattr(first_use.os, "geteuid", lambda: 0)
    assert first_use.sudo_prefix("maven") == []
