"""Every code example of the README and the documentation runs, against the real local services, as
a reader would run it (tests/support/examples.py says what counts as an example).

Node, Go and Java examples run with the clients of tests/clients (node-postgres, pgx, the PostgreSQL
JDBC driver), installed into the machine's caches on first use. Without node, go or java an example
in that language is skipped, except under CI=true, where it fails: CI must run them all."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from support.scripts import load_script
from support.teardown import drop_schema

from tests.support import examples
from tests.support.ci import skip_or_fail

REPO = Path(__file__).resolve().parents[1]
# The README and the documentation's pages.
SOURCES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

pytestmark = pytest.mark.xdist_group("docs-examples")  # they share the documented `reaper` schema


def _is_whole_page(path: Path) -> bool:
    return any(e.background for e in examples.examples(path))


WHOLE_PAGES = [p for p in SOURCES if _is_whole_page(p)]


def _collect() -> list[examples.Example]:
    found: list[examples.Example] = []
    for path in SOURCES:
        if path in WHOLE_PAGES:
            continue
        page: dict[str, list[examples.Example]] = {}
        for example in examples.examples(path):
            if example.page and not example.not_run:
                page.setdefault(example.language, []).append(example)
            else:
                found.append(example)
        for language, steps in page.items():  # a page's steps run as one script, named by the last
            code = "\n".join(step.code for step in steps)
            last = steps[-1]
            found.append(examples.Example(path, last.line, language, code, None, True))
    return found


EXAMPLES = _collect()


def _env(language: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if language == "node":
        env["NODE_PATH"] = str(_client("node"))
    if language == "go":
        env = _installer("go").toolchain.environment(str(_client("go")), env)
    return env


def _migrate_anew(pg_dsn: str) -> None:
    """The documented schema `reaper`, dropped and migrated as the README says (`reaper migrate`):
    what a reader has before the first example."""
    drop_schema(pg_dsn, "reaper")
    done = subprocess.run(
        [sys.executable, "-m", "harvester.cli", "migrate"],
        env={**_env(), "REAPER_DATABASE__DSN": pg_dsn},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def documented_schema(pg_dsn: str) -> str:
    _migrate_anew(pg_dsn)
    return "reaper"


def test_examples_are_found_and_every_one_shown_only_says_why():
    assert RUNS, "the documentation has examples to run"
    assert all(e.not_run is None or e.not_run.strip() for e in EXAMPLES)
    assert {e.language for e in EXAMPLES} >= {"sql", "node", "go", "java"}


def test_the_collector_reads_fences_directives_and_pages(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\n```python\nprint(1)\n```\n\n<!-- example: not run (needs a cluster) -->\n```sh\nmake x\n```\n\n"
        "```json\n{}\n```\n\n<!-- example: page -->\n```python\na = 1\n```\n\n````python\nprint(a)\n```\n````\n\n"
        "```console\n$ echo hi\nhi\n```\n"
    )
    found = examples.examples(page)
    assert [(e.line, e.language, e.not_run, e.page) for e in found] == [
        (3, "python", None, False),
        (8, "sh", "needs a cluster", False),
        (17, "python", None, True),
        (21, "python", None, True),
        (26, "sh", None, False),
    ]
    assert found[3].code == "print(a)\n```\n" and found[4].code == "echo hi\n"
    page.write_text("```javascript\nrequire('pg')\n```\n\n```go\npackage main\n```\n\n```java\nclass A {}\n```\n")
    assert [e.language for e in examples.examples(page)] == ["node", "go", "java"]
    for bad in (
        "<!-- example: not run -->\n```sh\nx\n```\n",
        "<!-- example: page -->\n```json\n{}\n```\n",
        "<!-- example: page -->\n```go\npackage main\n```\n",
        "```python\nx\n",
    ):
        page.write_text(bad)
        with pytest.raises(ValueError):
            examples.examples(page)


def test_a_page_joins_its_shell_blocks_whole_and_its_console_blocks_as_commands(tmp_path):
    """A failing check in a page's plain shell block fails the page, also when a console block
    (whose output lines are not run) is joined with it."""
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- example: page -->\n```sh\nexport A=1\ntest "$A" = 2\n```\n\n```console\n$ echo "$A"\n1\n```\n'
    )
    script = "\n".join(e.code for e in examples.examples(page))
    assert 'test "$A" = 2' in script and "\n1\n" not in script
    assert subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True).returncode != 0


CLIENTS = REPO / "tests" / "clients"
# What each language's examples need on the PATH, and where its client's installer lives.
# Commands that must be on the PATH before the client's installer runs (Go's installer fetches a
# toolchain itself when the machine has none recent enough).
TOOLCHAINS = {"node": (("node", "npm"), "node"), "go": ((), "go"), "java": (("java", "javac"), "jvm")}


@functools.cache
def _installer(client: str) -> ModuleType:
    installer = load_script(CLIENTS / client / "install.py", f"{client}_client_install")
    return installer


@functools.cache
def _client(language: str) -> object:
    """What tests/clients/<client>/install.py's install() returns (node_modules, go, a classpath),
    installing it on first use. A missing toolchain skips, or fails under CI."""
    commands, client = TOOLCHAINS[language]
    missing = [c for c in commands if shutil.which(c) is None]
    if missing:
        why = f"{language} examples need {', '.join(missing)} on the PATH"
        skip_or_fail(why)
    installer = _installer(client)
    try:
        return installer.install()
    except RuntimeError as exc:
        if client == "go" and isinstance(exc, installer.toolchain.ToolchainError):
            skip_or_fail(f"go examples: {exc}")  # no usable Go here, and none could be fetched
        pytest.fail(str(exc), pytrace=False)


def _command(example: examples.Example, pg_dsn: str, tmp_path: Path) -> tuple[list[str], Path, str | None]:
    if example.language == "node":
        (tmp_path / "example.cjs").write_text(example.code)
        return ["node", "example.cjs"], tmp_path, None
    if example.language == "go":
        go = _client("go")
        _installer("go").module(tmp_path, example.code)  # go.mod and go.sum of tests/clients/go
        return [str(go), "run", "-mod=mod", "."], tmp_path, None
    if example.language == "java":
        public = re.search(r"^public\s+(?:final\s+)?class\s+(\w+)", example.code, re.MULTILINE)
        source = tmp_path / f"{public.group(1) if public else 'Example'}.java"
        source.write_text(example.code)
        # C1 only and the serial collector: half the CPU of a default start for a program this short.
        fast = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
        return ["java", *fast, "-cp", str(_client("java")), source.name], tmp_path, None
    if example.language == "python":
        return [sys.executable, "-c", example.code], tmp_path, None
    if example.language == "sql":
        return ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", pg_dsn, "-f", "-"], tmp_path, example.code
    return ["bash", "-euo", "pipefail", "-c", example.code], REPO, None


def _run(example: examples.Example, pg_dsn: str, tmp_path: Path) -> None:
    command, cwd, stdin = _command(example, pg_dsn, tmp_path)
    env = _env(example.language)
    done = subprocess.run(command, input=stdin, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{example.name(REPO)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


# What runs: each example on its own, and each page with a background server as a whole.
RUNS: list[examples.Example | Path] = [*(e for e in EXAMPLES if not e.not_run), *WHOLE_PAGES]


def _run_name(run: examples.Example | Path) -> str:
    return str(run.relative_to(REPO)) if isinstance(run, Path) else run.name(REPO)


@pytest.mark.parametrize("run", RUNS, ids=_run_name)
def test_example_runs(run: examples.Example | Path, documented_schema: str, pg_dsn: str, tmp_path: Path) -> None:
    if isinstance(run, Path):
        _run_page(run, pg_dsn, tmp_path)
    else:
        _run(run, pg_dsn, tmp_path)


def _run_page(page: Path, pg_dsn: str, tmp_path: Path) -> None:
    """A page with a server in the background (a tutorial): its examples in order, as a reader
    following it would run them; a page-mode script runs at its last step. It starts from a new
    schema, as its reader does: the rows other pages' examples left (for topics this Kafka never
    had) are not in the outbox its server publishes."""
    _migrate_anew(pg_dsn)
    steps = [e for e in examples.examples(page) if not e.not_run]
    scripts: dict[str, list[examples.Example]] = {}
    for e in steps:
        if e.page:
            scripts.setdefault(e.language, []).append(e)
    servers: list[tuple[examples.Example, subprocess.Popen[bytes], Path]] = []
    try:
        for e in steps:
            if e.background:
                command, cwd, _ = _command(e, pg_dsn, tmp_path)
                log = tmp_path / f"background-{e.line}.log"
                with log.open("wb") as out:
                    server = subprocess.Popen(
                        command, cwd=cwd, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                    )
                servers.append((e, server, log))
            elif e.page:
                if e is scripts[e.language][-1]:
                    code = "\n".join(step.code for step in scripts[e.language])
                    _run(examples.Example(page, e.line, e.language, code, None, True), pg_dsn, tmp_path)
            else:
                _run(e, pg_dsn, tmp_path)
            for started, server, log in servers:
                assert server.poll() is None, f"{started.name(REPO)} stopped:\n{log.read_text()[-4000:]}"
    finally:
        for _, server, _ in servers:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGTERM)
        for _, server, _ in servers:
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
