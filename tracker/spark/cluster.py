"""SparkSessions for the tracker's jobs, and shipping the tracker to the executors.

Executors are Python processes of their own (on a real cluster, on other machines): they import
`tracker`, because the pickled partition functions name its modules, and its dependencies. The
tracker's code travels with the job; its dependencies do not:

- code: `tracker_zip()` builds a zip of the tracker package (content-addressed, deterministic)
  that `session()` adds with SparkContext.addPyFile, the same as `spark-submit --py-files`.
  Executors then run exactly the driver's version and a code change needs nothing on the nodes.
- dependencies (psycopg[binary], pyarrow, numpy, confluent-kafka, ...) hold compiled code, which
  a zip cannot carry: they are installed in the nodes' interpreter, named by
  `spark.pyspark.python` (`python=`), or shipped as a packed environment (`spark.archives` with a
  venv-pack archive; see the README).
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tempfile
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed zip timestamps: same code, same bytes, same name


def _package_files() -> list[tuple[str, bytes]]:
    root = Path(__file__).resolve().parents[1]  # the tracker package, wherever it is installed
    files = [
        (f"tracker/{p.relative_to(root).as_posix()}", p.read_bytes())
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    ]
    # tracker._sql (the migrations) may live elsewhere (an editable install maps it to sql/)
    sql_root = resources.files("tracker._sql")
    names = {n for n, _ in files}
    for entry in sorted(sql_root.iterdir(), key=lambda e: e.name):
        name = f"tracker/_sql/{entry.name}"
        if entry.is_file() and entry.name.endswith((".sql", ".py")) and name not in names:
            files.append((name, entry.read_bytes()))
    return files


def tracker_zip(directory: str | os.PathLike[str] | None = None) -> Path:
    """A zip of the tracker package for `--py-files` / addPyFile; rebuilt only when the code changes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in _package_files():
            z.writestr(zipfile.ZipInfo(name, _EPOCH), data)
    data = buf.getvalue()
    folder = Path(directory) if directory is not None else Path(tempfile.gettempdir()) / "outbox-reaper-pyfiles"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"tracker-{hashlib.sha256(data).hexdigest()[:16]}.zip"
    if not path.exists():
        # A private name per writer (process or thread), renamed into place whole.
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{path.name}.", suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.chmod(tmp, 0o644)  # as a plain write would have left it (mkstemp makes it 0600)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def session(
    master: str,
    *,
    jars: str | list[str] | None = None,
    app_name: str = "tracker",
    conf: dict[str, str] | None = None,
    python: str | None = None,
    ship: bool | None = None,
) -> Any:
    """A SparkSession for `master` (`spark://host:port`, `local[N]`, ...).

    `python`: the executors' interpreter (spark.pyspark.python; default this one), which must have
    the tracker's dependencies. `ship`: add `tracker_zip()` to the job (default: unless the master
    is local, whose Python workers import this interpreter's tracker). `jars`: the Kafka
    connector's jars for `ack_stream` (deploy/spark/jars.py prints them). The driver binds to
    loopback (executors here run on this machine; on a real cluster set spark.driver.host in
    `conf`), and has no UI. On a standalone cluster each executor gets 1g and 2 cores and the job
    at most 4 cores, so two jobs fit the local cluster at once; `conf` overrides any of it.
    """
    from pyspark.sql import SparkSession

    python = python or sys.executable
    local = master.startswith("local")
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.pyspark.python", python)
        .config("spark.pyspark.driver.python", sys.executable)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
    )
    if not local:
        builder = (
            builder.config("spark.executor.memory", "1g")
            .config("spark.executor.cores", "2")
            .config("spark.cores.max", "4")
        )
    if jars:
        builder = builder.config("spark.jars", jars if isinstance(jars, str) else ",".join(jars))
    for k, v in (conf or {}).items():
        builder = builder.config(k, v)
    # PySpark takes the executors' interpreter from PYSPARK_PYTHON when the context starts (the
    # conf is for spark-submit): set it for that moment only.
    saved = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = python
    try:
        spark = builder.getOrCreate()
    finally:
        if saved is None:
            del os.environ["PYSPARK_PYTHON"]
        else:
            os.environ["PYSPARK_PYTHON"] = saved
    if spark.sparkContext.pythonExec != python:
        raise RuntimeError(
            f"a SparkContext already runs with executors' Python {spark.sparkContext.pythonExec}, "
            f"not {python}: stop it first"
        )
    spark.sparkContext.setLogLevel("ERROR")
    if ship if ship is not None else not local:
        spark.sparkContext.addPyFile(str(tracker_zip()))
    return spark


def local_session(
    master: str = "local[2]",
    *,
    jars: str | list[str] | None = None,
    app_name: str = "tracker",
    conf: dict[str, str] | None = None,
) -> Any:
    """A SparkSession on this machine whose Python workers use this interpreter (and its tracker)."""
    return session(master, jars=jars, app_name=app_name, conf=conf, ship=False)
