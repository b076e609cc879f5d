"""The suite relies on `--dist loadgroup` keeping an xdist_group's tests on one worker (the cluster
fault tests share three brokers; the docs examples share the documented schema). A pytest or
pytest-xdist version that breaks that is caught here, not by collisions in those tests."""

from __future__ import annotations

import re
import subprocess
import sys


def test_a_groups_tests_run_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        "import pytest\n"
        "pytestmark = pytest.mark.xdist_group('together')\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_member(i):\n"
        "    pass\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            "-v",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers = re.findall(r"^\[(gw\d+)\].*PASSED.*test_member", done.stdout, re.M)
    assert len(workers) == 8 and len(set(workers)) == 1, done.stdout[-2000:]
