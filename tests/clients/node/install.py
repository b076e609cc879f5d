"""Install this folder's Node dependencies (node-postgres) into the machine's cache, once.

`npm ci` from the checked-in package-lock.json runs in a private folder that is renamed into place
when complete (deploy/local/first_use.py), so two installers at once, or one that is killed, never
leave a half-installed tree that looks usable. The folder is named by a digest of the lock file:
a changed lock file gets a new one. Used by tests/test_sql_node.py, resolved once by `make test`
before the suite, and runnable by hand: `python3 tests/clients/node/install.py`. Needs node and
npm (Debian: nodejs npm).

Environment: OUTBOX_NODE_CLIENT_CACHE (default <OUTBOX_CACHE_DIR or ~/.cache/outbox-reaper>/node-client).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "deploy" / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)


def cache_dir() -> Path:
    return Path(os.environ.get("OUTBOX_NODE_CLIENT_CACHE") or first_use.cache_root() / "node-client")


def _npm_ci(npm: str, folder: Path, pass_fds: tuple[int, ...]) -> None:
    shutil.copy(HERE / "package.json", folder / "package.json")
    shutil.copy(HERE / "package-lock.json", folder / "package-lock.json")  # exact versions, all the way down
    r = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        pass_fds=pass_fds,  # the install lock lives as long as npm does
    )
    if r.returncode != 0:
        raise RuntimeError(f"npm ci failed in {folder}:\n{r.stdout}\n{r.stderr}")
    want = json.loads((HERE / "package.json").read_text())["dependencies"]["pg"]
    have = folder / "node_modules" / "pg" / "package.json"
    if not have.exists() or json.loads(have.read_text()).get("version") != want:
        raise RuntimeError(f"npm ci did not install pg {want} into {folder}")


def install() -> Path:
    """Return the node_modules folder holding pg, installing it first if needed."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("node and npm are needed for the Node client test (Debian: apt-get install nodejs npm)")
    digest = hashlib.sha256((HERE / "package.json").read_bytes() + (HERE / "package-lock.json").read_bytes())
    target = cache_dir() / digest.hexdigest()[:16]
    first_use.populate(target, lambda folder, fds: _npm_ci(npm, folder, fds))
    return target / "node_modules"


if __name__ == "__main__":
    try:
        print(install())
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
