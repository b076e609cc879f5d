"""The executors' Python workers: a task's fixed cost of re-reading every zip on sys.path.

PySpark's worker calls importlib.invalidate_caches() at the start of every task. On Python 3.11
that makes each zipimporter read its archive's directory again at once: pyspark.zip (1,220
entries) once per package imported from it, and spark-core's jar (5,261 entries) twice, 0.33 s of
CPU per task on the local cluster, more than most of our tasks' own work. (From 3.12 on the
invalidation only drops the cached directory, read again on the next import from it: nothing to
do there.) `in_task` wraps the functions our jobs run on the executors; the first one a worker
runs makes its zip importers re-read an archive only when its file changed, so the tasks that
worker runs after it skip that cost. Files Spark adds to a job (addPyFile) are new paths, read as
before.

"Changed" is judged by the file's identity and times, as `os.stat` gives them (device, inode,
size, mtime and ctime in ns): an archive rewritten in place, or replaced by a rename, has a new
ctime or a new inode, whatever mtime it was given.
"""

from __future__ import annotations

import os
import sys
import zipimport
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "_tracker_unchanged_only"
_STAMP = "_tracker_stamp"
NEEDED = sys.version_info < (3, 12)  # from 3.12, invalidate_caches reads nothing at once


def _stamp(archive: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(archive)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def unchanged_zips_kept() -> None:
    """Make zipimporter.invalidate_caches re-read an archive only when its file changed
    (idempotent; for this process; nothing on Pythons that need it not)."""
    if not NEEDED:
        return
    cls: Any = zipimport.zipimporter
    original = cls.invalidate_caches
    if getattr(original, _MARK, False):
        return

    def invalidate_caches(self: Any) -> None:
        stamp = _stamp(self.archive)
        if stamp is not None and getattr(self, _STAMP, None) == stamp:
            return
        original(self)
        setattr(self, _STAMP, stamp)

    setattr(invalidate_caches, _MARK, True)
    cls.invalidate_caches = invalidate_caches
    # PySpark invalidated every cache just before this task began: what the importers hold now
    # is what their archives hold, so the next task need not read them again either.
    for importer in list(sys.path_importer_cache.values()):
        if isinstance(importer, zipimport.zipimporter):
            setattr(importer, _STAMP, _stamp(importer.archive))


def in_task(fn: F) -> F:
    """`fn` (a function Spark runs on the executors), first making the worker's zip caches steady.
    Not functools.wraps: cloudpickle would then find `fn`'s module and name on the wrapper, pickle
    `fn` by reference and lose the wrapper on the way to the executors."""

    def run(*args: Any, **kwargs: Any) -> Any:
        unchanged_zips_kept()
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
