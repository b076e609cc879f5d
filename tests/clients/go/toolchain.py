"""The go command for the Go examples: the machine's own when it is Go 1.25 or later, else a pinned
Go toolchain fetched once from Go's module proxy into the project's cache.

Go publishes each toolchain as a module on its proxy (golang.org/toolchain, the zip the go command
itself fetches when a go.mod asks for a newer Go). It is fetched over plain HTTPS, checked against
the SHA-256 pinned below (the checksum database is not reached from every machine, so the hash is
checked in, as go.sum is), and unpacked through deploy/local/first_use.populate: a private folder
renamed into place when whole, one builder at a time, an interrupted one's leftovers removed by the
next. Standard library only: it runs before any Go exists on the machine.

Environment: GOPROXY (its first http(s) entry; default https://proxy.golang.org),
OUTBOX_GO_TOOLCHAIN_CACHE (default <OUTBOX_CACHE_DIR or ~/.cache/outbox-reaper>/go-toolchain).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "deploy" / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)

MINIMUM = (1, 25)  # go.mod's `go 1.25.0`
VERSION = "1.25.14"
# SHA-256 of golang.org/toolchain@v0.0.1-go<VERSION>.linux-<arch>.zip as the proxy serves it.
SHA256 = {
    "amd64": "1bb543a7745d4c6e045a1bfdb4c4d5a0b05b71ee8b8ff72c0a351598b26991a4",
    "arm64": "eee0803776a2a3d42f0620d7b0156277350debb5d39c99a9b61c8b12108fd92c",
}
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class ToolchainError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("OUTBOX_GO_TOOLCHAIN_CACHE") or first_use.cache_root() / "go-toolchain")


def version_of(go: str) -> tuple[int, ...] | None:
    """(major, minor, ...) of the go command `go`, or None when it does not run or says no version."""
    try:
        r = subprocess.run(
            [go, "env", "GOVERSION"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GOTOOLCHAIN": "local"},
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.match(r"go(\d+)\.(\d+)", r.stdout.strip()) if r.returncode == 0 else None
    return (int(found.group(1)), int(found.group(2))) if found else None


def proxy() -> str:
    """The first http(s) entry of GOPROXY (`direct` and `off` cannot serve a toolchain zip)."""
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY", "")):
        if entry.startswith(("http://", "https://")):
            return entry.rstrip("/")
    return "https://proxy.golang.org"


def arch() -> str:
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in _ARCH:
        raise ToolchainError(
            f"no pinned Go toolchain for {sys.platform}/{machine}: install Go {'.'.join(map(str, MINIMUM))} "
            "or later (https://go.dev/dl)"
        )
    return _ARCH[machine]


def _fetch(folder: Path, fds: tuple[int, ...]) -> None:
    """Download, check and unpack the toolchain into the empty `folder` (first_use.Build)."""
    goarch = arch()
    name = f"v0.0.1-go{VERSION}.linux-{goarch}"
    url = f"{proxy()}/golang.org/toolchain/@v/{name}.zip"
    archive = folder / "toolchain.zip"
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as response, archive.open("wb") as out:
            while block := response.read(1 << 20):
                digest.update(block)
                out.write(block)
    except OSError as exc:
        raise ToolchainError(f"could not download the Go toolchain from {url}: {exc}") from exc
    if digest.hexdigest() != SHA256[goarch]:
        raise ToolchainError(f"{url} has SHA-256 {digest.hexdigest()}, not the pinned {SHA256[goarch]}: refused")
    prefix = f"golang.org/toolchain@{name}/"
    root = (folder / "go").resolve()
    with zipfile.ZipFile(archive) as z:
        for info in z.infolist():
            if not info.filename.startswith(prefix):
                raise ToolchainError(f"{url} holds {info.filename!r}, outside {prefix}")
            inner = info.filename[len(prefix) :]
            target = (root / inner).resolve()
            if root not in target.parents and target != root:
                raise ToolchainError(f"{url} holds {info.filename!r}, which would unpack outside its folder")
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = (info.external_attr >> 16) & 0o777
            os.chmod(target, mode or 0o644)
    archive.unlink()
    go = root / "bin" / "go"
    if version_of(str(go)) is None:
        raise ToolchainError(f"the Go toolchain unpacked from {url} does not run")


def go_command() -> str:
    """The go command to use: the machine's when it is recent enough, else the pinned toolchain's
    (fetched once). Run it with GOTOOLCHAIN=local, so it never switches toolchains by itself."""
    found = shutil.which("go")
    if found is not None and (version_of(found) or (0,)) >= MINIMUM:
        return found
    target = cache_dir() / f"go{VERSION}.linux-{arch()}"
    first_use.populate(target, _fetch, log=lambda msg: print(f"[go-toolchain] {msg}", file=sys.stderr, flush=True))
    return str(target / "go" / "bin" / "go")


if __name__ == "__main__":
    try:
        print(go_command())
    except (ToolchainError, first_use.FirstUseError) as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
