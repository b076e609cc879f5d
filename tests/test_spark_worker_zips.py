"""tracker.spark.worker: once a task has run, a worker's zip importers re-read an archive only
when its file changed (the per-task importlib.invalidate_caches() of PySpark's worker). No JVM:
the importer and the invalidation are the ones that worker uses."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile


def _zip(path, names: dict[str, str]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in names.items():
            z.writestr(name, text)


def test_an_unchanged_archive_is_not_read_again_and_a_changed_one_is(tmp_path):
    # in a process of its own: the change to zipimport is for the worker process that makes it
    archive = tmp_path / "lib.zip"
    _zip(archive, {"zmod_a.py": "A = 1\n"})
    code = f"""
import importlib, os, sys, zipimport
from tracker.spark.worker import in_task
sys.path.insert(0, {str(archive)!r})
import zmod_a
importer = sys.path_importer_cache[{str(archive)!r}]
assert type(importer) is zipimport.zipimporter
read = importer._files
importlib.invalidate_caches()
assert importer._files is not read  # before: every invalidation reads the directory again
assert list(in_task(lambda rows, extra: (r + extra for r in rows))(iter([1, 2]), extra=3)) == [4, 5]
importlib.invalidate_caches()  # the first after the change records the file's stamp
read = importer._files
importlib.invalidate_caches()
assert importer._files is read  # unchanged: not read again
import zipfile
with zipfile.ZipFile({str(archive)!r}, "a") as z:
    z.writestr("zmod_b.py", "B = 2\\n")
os.utime({str(archive)!r}, ns=(1, 1))
importlib.invalidate_caches()
assert importer._files is not read and "zmod_b.py" in importer._files
import zmod_b
assert zmod_b.B == 2
print("ok")
"""
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
