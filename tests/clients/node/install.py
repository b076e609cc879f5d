"""Install this folder's Node dependencies (node-postgres) into <repo>/.local/node-client, once.

Idempotent: does nothing when the pinned version is already there; else `npm ci` from the checked-in
package-lock.json. Used by tests/test_sql_node.py
and runnable by hand: `python3 tests/clients/node/install.py`. Needs node and npm (Debian: nodejs npm).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
TARGET = REPO / ".local" / "node-client"


def install() -> Path:
    """Return the node_modules folder holding pg, installing it first if needed."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise RuntimeError("node and npm are needed for the Node client test (Debian: apt-get install nodejs npm)")
    want = json.loads((HERE / "package.json").read_text())["dependencies"]["pg"]
    have = TARGET / "node_modules" / "pg" / "package.json"
    if have.exists() and json.loads(have.read_text()).get("version") == want:
        return TARGET / "node_modules"
    TARGET.mkdir(parents=True, exist_ok=True)
    shutil.copy(HERE / "package.json", TARGET / "package.json")
    shutil.copy(HERE / "package-lock.json", TARGET / "package-lock.json")  # exact versions, all the way down
    r = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
        cwd=TARGET,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode != 0:
        raise RuntimeError(f"npm install failed in {TARGET}:\n{r.stdout}\n{r.stderr}")
    return TARGET / "node_modules"


if __name__ == "__main__":
    try:
        print(install())
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
