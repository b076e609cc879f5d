"""Things fetched or built on first use, made safe for two processes at once and for interruption.

Every first-use download or build in the project (Kafka's jars and Spark's Kafka connector through
Maven, the Node client through npm, the Spark nodes' venv, the local Postgres cluster) goes through
`populate`, every Debian install through `apt_install`, every Maven run through `maven`:

- a folder is built in a private temporary folder beside its target (a fresh name per builder),
  written to disk, marked complete inside that folder and renamed into place in one step, so a
  reader sees either no target or a complete one, never a half-written one;
- builders of one target queue on a lock file beside it, so the second finds the first's result
  instead of building it again; a builder killed midway leaves only its temporary folder, which the
  next builder removes. The lock is handed to the build's child processes too (`pass_fds`), so a
  builder killed while its mvn or npm still runs keeps the others waiting until that child ends;
- a target without its completion mark (left by an older version of this code) is never used: it
  is rebuilt, unless its caller knows how to tell that it is whole (`adopt`);
- tools that are not safe to run twice at once on one machine (apt-get, Maven before 3.9 on one
  local repository) take a lock of the machine's, whatever cache folder the caller uses.

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
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

COMPLETE = ".complete"

# build(folder, pass_fds): fill the empty `folder`; give `pass_fds` to every subprocess it starts.
Build = Callable[[Path, tuple[int, ...]], None]


class FirstUseError(RuntimeError):
    pass


def cache_root() -> Path:
    """The per-machine cache shared by every checkout (read at each call: tests point it elsewhere)."""
    return Path(os.environ.get("OUTBOX_CACHE_DIR") or Path.home() / ".cache" / "outbox-reaper")


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[int]:
    """An exclusive lock between processes, held until its holder and every child it was passed
    to have closed it (the kernel releases it when they die). Yields the lock's descriptor."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # releases it unless a child still holds the same open file


def machine_lock(name: str) -> contextlib.AbstractContextManager[int]:
    """A lock of the whole machine (not of a cache folder, which tests and cold runs move)."""
    folder = Path("/var/lock")
    if not os.access(folder, os.W_OK):
        folder = Path(tempfile.gettempdir())
    return locked(folder / f"outbox-reaper-{name}.lock")


def is_complete(target: Path) -> bool:
    return (target / COMPLETE).is_file()


def _partial_prefix(target: Path) -> str:
    return f".{target.name}.partial-"


def _write_to_disk(folder: Path) -> None:
    """fsync every file and folder under `folder`, so its completion mark never outlives its contents."""
    for root, _dirs, files in os.walk(folder):
        for name in [*files, "."]:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def populate(
    target: Path,
    build: Build,
    *,
    adopt: Callable[[Path], bool] | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Return `target` once `build` has filled it completely, building it at most once.

    `build` fills an empty private folder and raises on failure; it may run for minutes (a
    download). It never sees `target` itself, so it may be interrupted at any point. `adopt(target)`
    says whether an unmarked target left by an older version of this code is whole (it is then
    marked, not rebuilt).
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock") as lock_fd:
        if is_complete(target):  # another process built it while this one waited
            return target
        if adopt is not None and target.is_dir() and adopt(target):
            (target / COMPLETE).write_text("adopted\n")
            return target
        # Left by builders that were killed: nobody else builds this target while we hold the lock
        # (a killed builder's children hold it too until they end).
        for stale in target.parent.glob(_partial_prefix(target) + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        if log is not None:
            log(f"building {target}")
        partial = Path(tempfile.mkdtemp(prefix=_partial_prefix(target), dir=target.parent))
        try:
            os.chmod(partial, 0o755)  # mkdtemp's 0700 would hide a shared cache from other users
            build(partial, (lock_fd,))
            _write_to_disk(partial)
            (partial / COMPLETE).write_text("complete\n")
            if target.is_symlink() or target.is_file():
                target.unlink()
            elif target.exists():
                shutil.rmtree(target)  # incomplete (checked above, under the lock)
            os.rename(partial, target)
            _write_to_disk_folder(target.parent)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return target


def _write_to_disk_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def maven(args: Sequence[str], *, pass_fds: tuple[int, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run mvn, one at a time per machine: Maven before 3.9 may corrupt a local repository that two
    runs write at once. The lock goes to mvn too, so it is held until mvn ends."""
    with machine_lock("maven") as fd:
        return subprocess.run(["mvn", *args], capture_output=True, text=True, check=False, pass_fds=(*pass_fds, fd))


def has_command(command: str) -> Callable[[], bool]:
    return lambda: shutil.which(command) is not None


def apt_install(package: str, present: Callable[[], bool], *, log: Callable[[str], None] | None = None) -> None:
    """Install Debian's `package` unless `present()`; one apt-get at a time per machine.

    `present()` is asked only under the machine's apt lock: while another process's apt-get runs,
    what it installs can look present (its command unpacked) before dpkg has configured it."""
    with machine_lock("apt") as fd:
        if present():  # there before, or installed by whoever held the lock before us
            return
        say = log or _stderr
        say(f"not found: installing Debian's {package}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sudo = sudo_prefix(package)
        # dpkg's own lock may be held by someone else's apt-get (unattended upgrades): wait for it.
        wait = ["-o", "DPkg::Lock::Timeout=600"]
        # `update` takes the lists lock, which DPkg::Lock::Timeout does not cover: retry it, and go
        # on with the lists there are if it keeps failing (install says what is missing).
        for attempt in range(6):
            update = subprocess.run(
                [*sudo, "apt-get", *wait, "update", "-q"], env=env, capture_output=True, text=True, pass_fds=(fd,)
            )
            if update.returncode == 0:
                break
            say(f"apt-get update failed (attempt {attempt + 1}): {update.stderr.strip()[-300:]}")
            time.sleep(5)
        cmd = [*sudo, "apt-get", *wait, "install", "-y", "-q", "--no-install-recommends", package]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, pass_fds=(fd,))
        if r.returncode != 0:
            raise FirstUseError(
                f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
            )
    if not present():
        raise FirstUseError(f"apt-get installed {package}, but what it should provide is still missing")


def sudo_prefix(package: str) -> list[str]:
    """What runs apt-get as root: nothing for root, else sudo with a prompt that says what it is for
    (the line before it may be held back, as `make caches` prints each step's output when it ends)."""
    if os.geteuid() == 0:
        return []
    return ["sudo", "-p", f"[first-use] password for %u, to install Debian's {package}: "]


def _stderr(msg: str) -> None:
    print(f"[first-use] {msg}", file=sys.stderr, flush=True)
