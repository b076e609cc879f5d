"""The Go examples' toolchain on a machine without a recent enough Go (tests/clients/go/toolchain.py):
fetched once from a Go module proxy, checked against its pinned SHA-256, safe when one fetch is
killed midway and when two run at once, and refused when the proxy serves other bytes.

The proxy here is a local HTTP server serving the real toolchain zip (fetched once per machine
from Go's proxy, with the same hash check), so the interruption can be timed and the served bytes
counted; the go command under test never finds the machine's own go on its PATH."""

from __future__ import annotations

import hashlib
import http.server
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.ci import skip_or_fail
from support.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "clients" / "go" / "toolchain.py"


toolchain = load_script(SCRIPT, "go_toolchain")
first_use = toolchain.first_use
try:
    ARCH: str | None = toolchain.arch()
except toolchain.ToolchainError:  # no pinned toolchain for this platform: the fetch tests cannot run
    ARCH = None
NAME = f"v0.0.1-go{toolchain.VERSION}.linux-{ARCH}"
ZIP_PATH = f"/golang.org/toolchain/@v/{NAME}.zip"


def _real_zip() -> bytes:
    """The real toolchain zip, fetched once per machine from Go's proxy and checked as toolchain.py does."""

    def fetch(folder: Path, fds: tuple[int, ...]) -> None:
        # Checked before the folder is marked complete: bad bytes are never kept.
        toolchain.download(
            f"{toolchain.proxy()}{ZIP_PATH}", folder / "toolchain.zip", toolchain.SHA256[toolchain.arch()]
        )

    folder = first_use.populate(first_use.cache_root() / "go-toolchain-zip" / NAME, fetch)
    data = (folder / "toolchain.zip").read_bytes()
    assert hashlib.sha256(data).hexdigest() == toolchain.SHA256[toolchain.arch()]
    return data


class _Proxy:
    """A Go module proxy serving one toolchain zip; `delay` seconds between 1 MiB blocks."""

    def __init__(self, data: bytes) -> None:
        self.data, self.delay, self.started, self.served = data, 0.0, 0, 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                if self.path != ZIP_PATH:
                    self.send_error(404)
                    return
                proxy.started += 1
                self.send_response(200)
                self.send_header("Content-Length", str(len(proxy.data)))
                self.end_headers()
                try:
                    for at in range(0, len(proxy.data), 1 << 20):
                        self.wfile.write(proxy.data[at : at + (1 << 20)])
                        time.sleep(proxy.delay)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the fetch was killed
                proxy.served += 1

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def real_zip() -> bytes:
    if ARCH is None:
        skip_or_fail(f"no Go toolchain is pinned for {sys.platform}/{platform.machine()}")
    return _real_zip()


@pytest.fixture
def proxy(real_zip):
    p = _Proxy(real_zip)
    yield p
    p.close()


def _env(proxy: _Proxy, cache: Path, path: str) -> dict[str, str]:
    # No go of the machine's on the PATH: only `path` (toolchain.py needs no other command).
    return {
        **os.environ,
        "PATH": path,
        "GOPROXY": f"{proxy.url},direct",
        "OUTBOX_GO_TOOLCHAIN_CACHE": str(cache),
    }


def _start(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _folders(cache: Path) -> list[Path]:
    return [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")] if cache.exists() else []


def test_fetched_once_through_a_kill_and_two_at_once_and_it_runs(proxy, tmp_path):
    cache = tmp_path / "toolchain"
    (tmp_path / "empty").mkdir()
    env = _env(proxy, cache, str(tmp_path / "empty"))
    proxy.delay = 0.05  # ~3 s for the whole zip: time to kill the first fetch midway
    first = _start(env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and first.poll() is None:
        partial = [f for f in cache.glob(".*.partial-*/toolchain.zip") if f.stat().st_size > (4 << 20)]
        if partial:
            break
        time.sleep(0.01)
    assert first.poll() is None, f"the first fetch ended before it could be killed: {first.communicate()}"
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert _folders(cache) == [], "a killed fetch left a folder where the toolchain goes"
    proxy.delay = 0.0
    served_before = proxy.served
    both = [_start(env) for _ in range(2)]
    outputs = []
    for proc in both:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{err}"
        outputs.append(out.strip().splitlines()[-1])
    assert outputs[0] == outputs[1], outputs
    assert proxy.served - served_before == 1, "two fetches at once downloaded the toolchain twice"
    folders = _folders(cache)
    assert len(folders) == 1 and first_use.is_complete(folders[0]), folders
    assert not list(cache.glob(".*.partial-*")), "the killed fetch's partial folder was left behind"
    version = subprocess.run(
        [outputs[0], "version"], capture_output=True, text=True, env={**env, "GOTOOLCHAIN": "local"}
    )
    assert version.returncode == 0 and f"go{toolchain.VERSION} " in version.stdout, version.stdout + version.stderr
    # Once there, it is used as it is: nothing more is fetched.
    again = _start(env)
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0 and out.strip().splitlines()[-1] == outputs[0], err
    assert proxy.started == 2  # the killed fetch's and the one whole download


def test_other_bytes_from_the_proxy_are_refused_and_leave_nothing(proxy, tmp_path, real_zip):
    cache = tmp_path / "toolchain"
    tampered = bytearray(real_zip)
    tampered[len(tampered) // 2] ^= 0xFF
    proxy.data = bytes(tampered)
    (tmp_path / "empty").mkdir()
    proc = _start(_env(proxy, cache, str(tmp_path / "empty")))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "not the pinned" in err and toolchain.SHA256[toolchain.arch()] in err, err
    assert _folders(cache) == [] and not list(cache.glob(".*.partial-*"))


def test_an_old_go_on_the_path_is_passed_over_and_a_recent_one_used(proxy, tmp_path):
    """The machine's go is used only from Go 1.25 on (go.mod's `go 1.25.0`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    go = bin_dir / "go"
    cache = tmp_path / "toolchain"
    for reported, used in [("go1.19.8", False), ("go1.25rc1", False), ("go1.25.0", True), ("go1.26.8", True)]:
        go.write_text(f'#!/bin/sh\n[ "$1 $2" = "env GOVERSION" ] && echo {reported}\n')
        go.chmod(0o755)
        assert toolchain.version_of(str(go)) == toolchain.parse_version(reported)
        proc = _start(_env(proxy, cache, str(bin_dir)))
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        chosen = out.strip().splitlines()[-1]
        assert (chosen == str(go)) is used, (reported, chosen)


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("go1.25.0", (1, 25, 0, 1)),
        ("go1.25", (1, 25, 0, 1)),
        ("go1.25.14\n", (1, 25, 14, 1)),
        ("go1.25rc1", (1, 25, 0, 0)),
        ("go1.26beta2", (1, 26, 0, 0)),
        ("go1.26.8 X:boringcrypto", (1, 26, 8, 1)),
        ("devel go1.26-abcdef Tue", None),
        ("", None),
        ("gccgo", None),
    ],
)
def test_go_versions_are_read_as_go_orders_them(text, parsed):
    assert toolchain.parse_version(text) == parsed
    if parsed is not None:
        assert (parsed >= toolchain.MINIMUM) == (parsed[:2] > (1, 25) or parsed[:2] == (1, 25) and parsed[3] == 1)


@pytest.mark.parametrize(
    "goproxy, bases",
    [
        ("", ["https://proxy.golang.org"]),
        ("https://a.example/ , direct", ["https://a.example", toolchain.DIRECT]),
        ("goproxy.example|https://b.example/x/", ["https://goproxy.example", "https://b.example/x"]),
        ("direct", [toolchain.DIRECT]),
        ("https://a.example,off,https://b.example", ["https://a.example"]),
    ],
)
def test_goproxy_entries_are_read_as_go_reads_them(monkeypatch, goproxy, bases):
    monkeypatch.setenv("GOPROXY", goproxy)
    assert toolchain.proxies() == bases


def test_goproxy_off_refuses_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("GOPROXY", "off")
    with pytest.raises(toolchain.ToolchainError, match="GOPROXY=off"):
        toolchain.proxies()


def test_a_proxy_without_the_toolchain_passes_to_the_next_entry(proxy, tmp_path):
    cache = tmp_path / "toolchain"
    (tmp_path / "empty").mkdir()
    env = _env(proxy, cache, str(tmp_path / "empty"))
    env["GOPROXY"] = f"{proxy.url}/nothing-here,{proxy.url}"
    proc = _start(env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert proxy.served == 1 and Path(out.strip().splitlines()[-1]).is_file()


def test_the_fetched_go_ignores_another_gos_goroot(proxy, tmp_path):
    cache = tmp_path / "toolchain"
    (tmp_path / "empty").mkdir()
    env = _env(proxy, cache, str(tmp_path / "empty"))
    proc = _start(env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    go = out.strip().splitlines()[-1]
    other = tmp_path / "other-goroot"
    other.mkdir()
    run_env = toolchain.environment(go, {**env, "GOROOT": str(other), "OUTBOX_GO_TOOLCHAIN_CACHE": str(cache)})
    assert "GOROOT" not in run_env and run_env["GOTOOLCHAIN"] == "local"
