"""tracker.spark.worker: once a tracker task has run, a worker's zip importers re-read an archive
only when its file changed (the per-task importlib.invalidate_caches() of PySpark's worker), and a
changed file is noticed however it was changed. No JVM: the importer and the invalidation are the
ones that worker uses."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

import tracker.spark
from tracker.spark import worker


def _zip(path, names: dict[str, str]) -> None:
    with zipfile.ZipFile(path, "w") as z:
        for name, text in names.items():
            z.writestr(name, text)


def _run(code: str) -> None:
    # in a process of its own: the change to zipimport is for the worker process that makes it
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(not worker.NEEDED, reason="from Python 3.12 on, an invalidation reads no archive")
def test_an_unchanged_archive_is_not_read_again_and_a_changed_one_is_however_it_changed(tmp_path):
    archive, other = tmp_path / "lib.zip", tmp_path / "other.zip"
    _zip(archive, {"zmod_a.py": "A = 1\n"})
    _zip(other, {"zmod_a.py": "A = 2\n"})  # the same size as lib.zip's first version
    assert archive.stat().st_size == other.stat().st_size
    code = f"""
import importlib, os, sys, time, zipfile, zipimport
from tracker.spark.worker import in_task
archive, other = {str(archive)!r}, {str(other)!r}
sys.path.insert(0, archive)
import zmod_a
importer = sys.path_importer_cache[archive]
assert type(importer) is zipimport.zipimporter
read = importer._files
importlib.invalidate_caches()
assert importer._files is not read  # before: every invalidation reads the directory again
assert list(in_task(lambda rows, extra: (r + extra for r in rows))(iter([1, 2]), extra=3)) == [4, 5]
read = importer._files
importlib.invalidate_caches()
assert importer._files is read  # unchanged since the task began: not read again, from the next task on

def changed(how):
    global read
    time.sleep(0.05)  # past the file system's timestamp tick
    how()
    importlib.invalidate_caches()
    assert importer._files is not read, how.__name__
    read = importer._files
    importlib.invalidate_caches()
    assert importer._files is read, how.__name__

def replaced_by_a_rename_with_the_same_size_and_mtime():
    st = os.stat(archive)
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, archive)

def rewritten_in_place_with_the_same_size_and_mtime():
    st = os.stat(archive)
    with open(archive, "rb") as f:
        data = f.read()
    with open(archive, "r+b") as f:
        f.write(data.replace(b"A = 2", b"A = 3"))
    os.utime(archive, ns=(st.st_atime_ns, st.st_mtime_ns))

def grown():
    with zipfile.ZipFile(archive, "a") as z:
        z.writestr("zmod_b.py", "B = 2\\n")

changed(replaced_by_a_rename_with_the_same_size_and_mtime)
changed(rewritten_in_place_with_the_same_size_and_mtime)
changed(grown)
import zmod_b
assert zmod_b.B == 2
print("ok")
"""
    _run(code)


def test_from_python_3_12_on_zipimport_is_left_as_it_is():
    code = """
import zipimport
from tracker.spark import worker
before = zipimport.zipimporter.invalidate_caches
assert list(worker.in_task(lambda rows: rows)(iter([1]))) == [1]
assert (zipimport.zipimporter.invalidate_caches is before) is (not worker.NEEDED)
print("ok")
"""
    _run(code)


# The DataFrame and RDD methods whose function argument runs inside an executor's task, by name
# (filter and groupBy are left out: on a DataFrame they take columns, not functions).
EXECUTOR_METHODS = {
    "mapInArrow",
    "mapInPandas",
    "applyInArrow",
    "applyInPandas",
    "applyInPandasWithState",
    "mapPartitions",
    "mapPartitionsWithIndex",
    "foreachPartition",
    "foreach",
    "map",
    "flatMap",
    "mapValues",
    "flatMapValues",
    "keyBy",
    "sortBy",
    "aggregate",
    "treeAggregate",
}
UDFS = {"udf", "pandas_udf"}  # F.udf(f), pandas_udf(f): run on the executors too


def _function_of(call: ast.Call) -> ast.expr | None:
    """The function a call hands over: its first argument, or the keyword PySpark names it by."""
    if call.args:
        return call.args[0]
    return next((k.value for k in call.keywords if k.arg in ("func", "f")), None)


def test_every_function_tracker_spark_sends_to_the_executors_goes_through_in_task():
    """A function handed to the executors without in_task would bring the per-task re-reading back
    for that stage, silently: each call site is read from the source. (Functions that only ride in
    a stage a wrapped one starts, as reduceByKey's, need no wrapping: the worker is patched.)"""
    sites, unwrapped = 0, []
    for path in sorted(pathlib.Path(tracker.spark.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name not in EXECUTOR_METHODS | UDFS or (name in EXECUTOR_METHODS and isinstance(node.func, ast.Name)):
                continue
            sites += 1
            fn = _function_of(node)
            if not (isinstance(fn, ast.Call) and isinstance(fn.func, ast.Name) and fn.func.id == "in_task"):
                shown = "no function found" if fn is None else ast.unparse(fn)
                unwrapped.append(f"{path.name}:{node.lineno} {name}({shown})")
    assert sites >= 8, f"only {sites} executor call sites found: the scan no longer sees them"
    assert unwrapped == [], unwrapped
