"""The errors reference lists every public error the tracker raises, wherever it is defined, under
the name it is imported by."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import tracker
from tracker.errors import TrackerError

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy import docs_reference  # noqa: E402


def _public_errors() -> set[str]:
    found: set[str] = set()
    for info in pkgutil.walk_packages(tracker.__path__, "tracker."):
        if ".spark" in info.name or info.name.rpartition(".")[2].startswith("_"):
            continue  # Spark's modules need pyspark; private modules export nothing
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and issubclass(value, TrackerError)
                and not name.startswith("_")
                and value.__module__ == info.name
            ):
                found.add(f"{info.name}.{name}")
    return found


def test_every_public_tracker_error_is_on_the_errors_page():
    page = docs_reference.errors_page()
    missing = sorted(name for name in _public_errors() if f"`{name}`" not in page)
    assert not missing, f"not on the errors page: {missing}"
