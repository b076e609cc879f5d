"""Things fetched or built on first use, made safe for two processes at once and for interruption.

Every first-use download in the project (Kafka's jars, Spark's Kafka connector, the Node client,
the Spark nodes' Python) goes through `populate`, and every Debian install through `apt_install`:

- a folder is built in a private temporary folder beside its target (a fresh name per builder),
  marked complete inside that folder, and renamed into place in one step, so a reader sees either
  no target or a complete one, never a half-written one;
- builders of one target queue on a lock file beside it, so the second finds the first's result
  instead of downloading again; a builder killed midway leaves only its temporary folder, which the
  next builder removes;
- a target without its completion mark (left by an older version of this code) is never used: it
  is rebuilt.

Standard library only: the service scripts run it before the project's virtualenv exists.
Environment: OUTBOX_CACHE_DIR, the per-machine cache (default ~/.cache/outbox-reaper).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

COMPLETE = ".complete"


def cache_root() -> Path:
    """The per-machine cache shared by every checkout (read at each call: tests point it elsewhere)."""
    return Path(os.environ.get("OUTBOX_CACHE_DIR") or Path.home() / ".cache" / "outbox-reaper")


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between processes; the kernel releases it when its holder dies."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def is_complete(target: Path) -> bool:
    return (target / COMPLETE).is_file()


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}.partial-"


def populate(target: Path, build: Callable[[Path], None], *, log: Callable[[str], None] | None = None) -> Path:
    """Return `target` once `build(folder)` has filled it completely, building it at most once.

    `build` fills an empty private folder and raises on failure; it may run for minutes (a
    download). It never sees `target` itself, so it may be interrupted at any point.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock"):
        if is_complete(target):  # another process built it while this one waited
            return target
        # Left by builders that were killed: nobody else builds this target while we hold the lock.
        for stale in target.parent.glob(_temporary_prefix(target) + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        if log is not None:
            log(f"building {target}")
        partial = Path(tempfile.mkdtemp(prefix=_temporary_prefix(target), dir=target.parent))
        try:
            build(partial)
            # The contents reach the disk before the mark that vouches for them.
            os.sync()
            (partial / COMPLETE).write_text("complete\n")
            if target.exists() or target.is_symlink():
                # Incomplete (checked above under the lock): left by an older version of this code.
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            os.rename(partial, target)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return target


def has_command(command: str) -> Callable[[], bool]:
    return lambda: shutil.which(command) is not None


def apt_install(package: str, present: Callable[[], bool], *, log: Callable[[str], None] | None = None) -> None:
    """Install Debian's `package` unless `present()`; one install at a time per machine."""
    if present():
        return
    with locked(cache_root() / "locks" / "apt.lock"):
        if present():  # installed by whoever held the lock before us
            return
        (log or _stderr)(f"not found: installing Debian's {package}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sudo = [] if os.geteuid() == 0 else ["sudo"]
        # Wait for dpkg's own lock too (another project's apt-get, unattended upgrades).
        wait = ["-o", "DPkg::Lock::Timeout=600"]
        for cmd in (
            [*sudo, "apt-get", *wait, "update", "-q"],
            [*sudo, "apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", package],
        ):
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise FirstUseError(
                    f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
                )
    if not present():
        raise FirstUseError(f"apt-get installed {package}, but what it should provide is still missing")


class FirstUseError(RuntimeError):
    pass


def _stderr(msg: str) -> None:
    print(f"[first-use] {msg}", file=sys.stderr, flush=True)
