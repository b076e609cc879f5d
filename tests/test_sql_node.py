"""The SQL functions from a non-Python client: Node with node-postgres, run by node's test runner.

pg is installed from npm into the machine cache by tests/clients/node/install.py (once, safely).
Without node/npm the test fails (it never skips): CI must be able to run it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support.scripts import load_script

NODE_DIR = Path(__file__).resolve().parent / "clients" / "node"


def test_node_client_drives_the_sql_functions(pg_dsn, schema):
    installer = load_script(NODE_DIR / "install.py", "node_install")
    try:
        modules = installer.install()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    env = {**os.environ, "NODE_PATH": str(modules), "OUTBOX_TEST_DSN": pg_dsn, "TRACKER_SCHEMA": schema}
    r = subprocess.run(
        [shutil.which("node"), "--test", str(NODE_DIR / "sql_functions.test.cjs")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# pass 5" in r.stdout and "# fail 0" in r.stdout, r.stdout
