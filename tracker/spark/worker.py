"""The executors' Python workers: a task's fixed cost of re-reading every zip on sys.path.

PySpark's worker calls importlib.invalidate_caches() at the start of every task. On the Pythons
whose zipimporter re-reads its archive's directory there (3.11 here), that re-reads pyspark.zip
(1,220 entries) once per package imported from it, and spark-core's jar (5,261 entries) twice:
0.33 s of CPU per task on the local cluster, more than most of our tasks' own work. `in_task`
wraps the functions our jobs run on the executors; the first one a worker runs makes its zip
importers re-read an archive only when the file changed (size or mtime), so the tasks that worker
runs after it skip that cost. Files Spark adds to a job (addPyFile) are new paths, read as before.
"""

from __future__ import annotations

import os
import zipimport
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_tracker_unchanged_only"


def unchanged_zips_kept() -> None:
    """Make zipimporter.invalidate_caches re-read an archive only when its file changed
    (idempotent; for this process)."""
    cls: Any = zipimport.zipimporter
    original = cls.invalidate_caches
    if getattr(original, _MARK, False):
        return

    def invalidate_caches(self: Any) -> None:
        try:
            st = os.stat(self.archive)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is not None and getattr(self, "_tracker_stamp", None) == stamp:
            return
        original(self)
        self._tracker_stamp = stamp

    setattr(invalidate_caches, _MARK, True)
    cls.invalidate_caches = invalidate_caches


def in_task(fn: F) -> F:
    """`fn` (a function Spark runs on the executors), first making the worker's zip caches steady."""

    def run(*args: Any, **kwargs: Any) -> Any:
        unchanged_zips_kept()
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
