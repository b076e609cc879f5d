"""An interrupted run (Ctrl-C, or CI's time limit) names the tests still running: under xdist they
are in no summary, duration list or report, and they are the ones to look at.

Hooks imported by conftest: the controller hears of every test's start and end, whichever worker
runs it, and keeps those started and not ended."""

from __future__ import annotations

import pytest

_running: dict[str, None] = {}  # node ids, in the order they started


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _running[nodeid] = None


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _running.pop(nodeid, None)


def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    if _running:
        print("\ninterrupted while these tests ran:", *_running, sep="\n  ", flush=True)
