"""Download the Go module graph of go.mod/go.sum (pgx v5) into Go's own module cache, and build it once.

The documentation's Go examples (tests/test_docs_examples.py) each run as `go run .` in a fresh
module made of this folder's go.mod and go.sum and the example as main.go. This script fills the
module cache (GOMODCACHE) and the build cache (GOCACHE) beforehand by building a program that
imports the same packages, so an example compiles without the network and in seconds. Both caches
are Go's: the go command already makes them safe for several processes at once (file locks) and
for interruption (a download is unpacked aside and renamed into place), so nothing is added here;
running it again is cheap and changes nothing. The go.sum is checked in and used read-only
(-mod=readonly): a module whose hash differs fails the build. Resolved once by `make caches`, and
runnable by hand: `python3 tests/clients/go/install.py`. Uses the machine's go when it is Go 1.25 or
later, else fetches a pinned toolchain from Go's module proxy once (toolchain.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import toolchain  # noqa: E402  (this folder's toolchain.py, standard library only)

# Imports the packages the examples use, so their dependencies are downloaded and compiled.
_WARM = """package main

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func main() {
	var _ *pgconn.PgError
	_, _ = pgx.Connect(context.Background(), "")
}
"""


def module(folder: Path, main: str) -> None:
    """Make `folder` a module of this folder's go.mod and go.sum, with `main` as its main.go."""
    for name in ("go.mod", "go.sum"):
        shutil.copy(HERE / name, folder / name)
    (folder / "main.go").write_text(main)


def install() -> str:
    """Return the go command, once the module and build caches hold what the examples import."""
    go = toolchain.go_command()
    with tempfile.TemporaryDirectory(prefix="outbox-reaper-go-") as tmp:
        module(Path(tmp), _WARM)
        r = subprocess.run(
            [go, "build", "-mod=readonly", "-o", os.devnull, "."],
            cwd=tmp,
            env=toolchain.environment(go),
            capture_output=True,
            text=True,
            timeout=600,
        )
    if r.returncode != 0:
        raise RuntimeError(f"go could not download or build pgx from {HERE / 'go.mod'}:\n{r.stdout}\n{r.stderr}")
    return go


if __name__ == "__main__":
    try:
        print(install())
    except RuntimeError as exc:  # toolchain.ToolchainError and first_use.FirstUseError among them
        print(exc, file=sys.stderr)
        sys.exit(1)
