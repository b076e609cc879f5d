"""The go command for the Go examples: the machine's own when it is Go 1.25 or later, else a pinned
Go toolchain fetched once from Go's module proxy into the project's cache.

Go publishes each toolchain as a module on its proxy (golang.org/toolchain, the zip the go command
itself fetches when a go.mod asks for a newer Go). It is fetched over plain HTTPS, checked against
the SHA-256 pinned below (the checksum database is not reached from every machine, so the hash is
checked in, as go.sum is), and unpacked through deploy/local/first_use.populate: a private folder
renamed into place when whole, one builder at a time, an interrupted one's leftovers removed by the
next. Standard library only: it runs before any Go exists on the machine.

Environment: GOPROXY (its entries in turn, as Go reads them: `direct` is go.dev's own module
server for toolchains, `off` refuses; default https://proxy.golang.org), OUTBOX_GO_TOOLCHAIN_CACHE
(default <OUTBOX_CACHE_DIR or ~/.cache/outbox-reaper>/go-toolchain). The fetched go runs with
`environment()`: no GOROOT of another Go, GOTOOLCHAIN=local.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "deploy" / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)

MINIMUM = (1, 25, 0, 1)  # go.mod's `go 1.25.0`: (major, minor, patch, 1 for a release, 0 for rc/beta)
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


def environment(go: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment to run `go` in: GOTOOLCHAIN=local (it never downloads a toolchain of its
    own), and no GOROOT when `go` sits in a Go tree of its own, as the fetched toolchain does (it
    finds that tree itself; another Go's GOROOT would make it build with that Go's compiler)."""
    env = dict(os.environ if environ is None else environ)
    if (Path(go).resolve().parents[1] / "src" / "runtime").is_dir():
        env.pop("GOROOT", None)
    env["GOTOOLCHAIN"] = "local"
    return env


def parse_version(text: str) -> tuple[int, int, int, int] | None:
    """(major, minor, patch, release) of a GOVERSION such as go1.25.3 or go1.26rc1 (release 0: a
    release candidate or beta, which comes before the .0 release); None for anything else
    (`devel go1.26-abcdef`, a version Go itself does not order)."""
    found = re.fullmatch(r"go(\d+)\.(\d+)(?:\.(\d+))?((?:rc|beta)\d+)?(?:\s.*)?", text.strip())
    if found is None:
        return None
    major, minor, patch, pre = found.groups()
    return int(major), int(minor), int(patch or 0), 0 if pre else 1


def version_of(go: str) -> tuple[int, int, int, int] | None:
    """parse_version of what the go command `go` says, or None when it does not run."""
    try:
        r = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, timeout=60, env=environment(go))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_version(r.stdout) if r.returncode == 0 else None


DIRECT = "https://go.dev/dl/mod"  # where Go itself fetches toolchains under GOPROXY=direct


def proxies() -> list[str]:
    """GOPROXY's entries in order, as base URLs (a bare host gets https://; `direct` is go.dev's
    toolchain server); an entry after `off`, and `off` alone, are refused."""
    found = []
    for entry in re.split(r"[,|]", os.environ.get("GOPROXY", "") or "https://proxy.golang.org"):
        entry = entry.strip()
        if not entry:
            continue
        if entry == "off":
            if not found:
                raise ToolchainError("GOPROXY=off: no Go toolchain can be downloaded; install Go 1.25 or later")
            break
        if entry == "direct":
            entry = DIRECT
        elif not entry.startswith(("http://", "https://")):
            entry = f"https://{entry}"
        found.append(entry.rstrip("/"))
    return found or ["https://proxy.golang.org"]


def proxy() -> str:
    return proxies()[0]


def arch() -> str:
    machine = platform.machine().lower()
    if sys.platform != "linux" or machine not in _ARCH:
        raise ToolchainError(
            f"no pinned Go toolchain for {sys.platform}/{machine}: install Go 1.25 or later (https://go.dev/dl)"
        )
    return _ARCH[machine]


def download(url: str, archive: Path, sha256: str) -> None:
    """`url` into `archive`, whole (its Content-Length) and with the SHA-256 `sha256`, or raise
    ToolchainError; a 404 or 410 (the next GOPROXY entry may have it) as urllib.error.HTTPError."""
    digest, size = hashlib.sha256(), 0
    try:
        with urllib.request.urlopen(url, timeout=120) as response, archive.open("wb") as out:
            expected = response.headers.get("Content-Length")
            while block := response.read(1 << 20):
                digest.update(block)
                out.write(block)
                size += len(block)
    except urllib.error.HTTPError as exc:
        if exc.code in (404, 410):
            raise
        raise ToolchainError(f"could not download the Go toolchain from {url}: {exc}") from exc
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ToolchainError(f"could not download the Go toolchain from {url}: {exc!r}") from exc
    if expected is not None and expected.isdigit() and size != int(expected):
        raise ToolchainError(f"the download from {url} ended after {size} of {expected} bytes")
    if digest.hexdigest() != sha256:
        raise ToolchainError(f"{url} has SHA-256 {digest.hexdigest()}, not the pinned {sha256}: refused")


def _fetch(folder: Path, fds: tuple[int, ...]) -> None:
    """Download, check and unpack the toolchain into the empty `folder` (first_use.Build)."""
    goarch = arch()
    name = f"v0.0.1-go{VERSION}.linux-{goarch}"
    archive = folder / "toolchain.zip"
    tried = []
    for base in proxies():
        url = f"{base}/golang.org/toolchain/@v/{name}.zip"
        try:
            download(url, archive, SHA256[goarch])
            break
        except urllib.error.HTTPError as exc:  # not there: the next entry, as Go does after a comma
            tried.append(f"{url}: {exc.code}")
    else:
        raise ToolchainError(f"no GOPROXY entry serves the Go toolchain: {'; '.join(tried)}")
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
            kind = stat.S_IFMT(info.external_attr >> 16)
            if kind not in (0, stat.S_IFREG):  # 0: a zip that records no type (a plain file)
                raise ToolchainError(f"{url} holds {info.filename!r}, which is not a plain file")
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, target.open("wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(target, ((info.external_attr >> 16) & 0o755) or 0o644)
    archive.unlink()
    go = str(root / "bin" / "go")
    # It runs, and from its own tree (GOVERSION alone would pass with another Go's GOROOT).
    r = subprocess.run([go, "env", "GOROOT"], capture_output=True, text=True, timeout=60, env=environment(go))
    if r.returncode != 0 or Path(r.stdout.strip()).resolve() != root:
        raise ToolchainError(f"the Go toolchain unpacked from {url} does not run from {root}: {r.stdout}{r.stderr}")


def go_command() -> str:
    """The go command to use: the machine's when it is recent enough, else the pinned toolchain's
    (fetched once). Run it with GOTOOLCHAIN=local, so it never switches toolchains by itself."""
    found = shutil.which("go")
    if found is not None and (version_of(found) or (0, 0, 0, 0)) >= MINIMUM:
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
