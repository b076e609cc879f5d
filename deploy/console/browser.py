#!/usr/bin/env python3
"""Headless Chromium and its WebDriver for the console's browser tests, from Debian's packages.

    python3 deploy/console/browser.py install    # apt-get install chromium chromium-driver when missing

Safe when two processes install at once (one apt-get at a time per machine, deploy/local/first_use.py)
and when interrupted (apt-get itself picks up where it stopped). Standard library only.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


class BrowserError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[browser] {msg}", flush=True)


def _present(path: str) -> bool:
    return os.access(path, os.X_OK) or shutil.which(Path(path).name) is not None


def ensure_installed() -> tuple[str, str]:
    """The paths of chromium and chromedriver, installing Debian's packages when missing."""
    try:
        first_use.apt_install("chromium", lambda: _present(CHROMIUM), log=log)
        first_use.apt_install("chromium-driver", lambda: _present(CHROMEDRIVER), log=log)
    except first_use.FirstUseError as exc:
        raise BrowserError(str(exc)) from None
    return found()  # type: ignore[return-value]  # apt_install checked both


def found() -> tuple[str, str] | None:
    browser = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    driver = CHROMEDRIVER if os.access(CHROMEDRIVER, os.X_OK) else shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def main(argv: list[str]) -> int:
    if argv[1:] != ["install"]:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        browser, driver = ensure_installed()
    except BrowserError as exc:
        log(str(exc))
        return 1
    log(f"chromium {browser}, chromedriver {driver}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
