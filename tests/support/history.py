"""Files of this repository at an earlier commit, read from its git history (the upgrade tests)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from support.ci import under_ci

REPO = Path(__file__).resolve().parents[2]


def files_at(commit: str, paths: list[str], into: Path) -> Path:
    """`paths` (files or folders) as they were at `commit`, extracted under `into`; returns `into`.
    Without the git history the test skips, and fails under CI (CI runs in a clone: the history is
    there)."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, *paths], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        if under_ci():
            raise
        pytest.skip(f"needs the git history of this repository (commit {commit})")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def sql_at(commit: str, into: Path) -> Path:
    """`sql/` as it was at `commit`, extracted under `into`; returns that directory (files_at)."""
    return files_at(commit, ["sql"], into) / "sql"
