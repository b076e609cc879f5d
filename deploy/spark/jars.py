#!/usr/bin/env python3
"""Spark's Kafka connector (spark-sql-kafka-0-10) for the Structured Streaming ack job.

    .venv/bin/python deploy/spark/jars.py      # prints SPARK_KAFKA_JARS=<comma-separated jar paths>

Resolves the connector matching the installed pyspark from Maven Central once, by
`mvn dependency:copy-dependencies` on deploy/spark/pom.xml (as deploy/local/services.py does for the
Kafka broker), and caches the jars per machine. Jars that pyspark already ships (Scala, Hadoop
client, slf4j, ...) are left out, so the session's classpath holds one copy of each. Standard
library only; run it with the interpreter that has pyspark installed.

Environment: OUTBOX_SPARK_JARS_CACHE (default ~/.cache/outbox-reaper/spark-kafka-jars).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
CACHE = Path(os.environ.get("OUTBOX_SPARK_JARS_CACHE", Path.home() / ".cache" / "outbox-reaper" / "spark-kafka-jars"))
_JAR = re.compile(r"^(?P<artifact>.+)-(?P<version>\d[\w.]*)\.jar$")


class JarResolutionError(RuntimeError):
    pass


def _artifact(jar_name: str) -> str:
    m = _JAR.match(jar_name)
    return m.group("artifact") if m else jar_name


def pyspark_version() -> str:
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        raise JarResolutionError("pyspark is not installed in this interpreter: pip install -e '.[spark]'") from None


def pyspark_jars_dir() -> Path:
    spec = importlib.util.find_spec("pyspark")
    if spec is None or spec.origin is None:
        raise JarResolutionError("pyspark is not installed in this interpreter: pip install -e '.[spark]'")
    return Path(spec.origin).parent / "jars"


def _ensure_maven() -> None:
    """Install Maven from Debian's packages when missing (root, or sudo), as services.py does."""
    if shutil.which("mvn") is not None:
        return
    print("[spark-jars] mvn not found: installing Debian's maven", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    for cmd in (
        [*sudo, "apt-get", "update", "-q"],
        [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", "maven"],
    ):
        if subprocess.run(cmd, env=env, check=False).returncode != 0:
            break
    if shutil.which("mvn") is None:
        raise JarResolutionError("mvn is required to resolve the Spark Kafka connector: apt-get install maven")


def _resolve(version: str, target: Path) -> None:
    _ensure_maven()
    tmp = target.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run(
        [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(POM),
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-Dspark.version={version}",
            f"-DoutputDirectory={tmp}",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise JarResolutionError(
            f"mvn could not resolve spark-sql-kafka-0-10 {version} (it must match the installed pyspark):\n"
            f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


def spark_kafka_jars(version: str | None = None) -> list[Path]:
    """The connector's jars for `version` (default: the installed pyspark's), less those pyspark ships."""
    version = version or pyspark_version()
    digest = hashlib.sha256(POM.read_bytes() + version.encode()).hexdigest()[:16]
    cache = CACHE / f"{version}-{digest}"
    if not (cache / ".complete").exists():
        print(
            f"[spark-jars] resolving spark-sql-kafka-0-10 {version} from Maven Central into {cache}",
            file=sys.stderr,
            flush=True,
        )
        _resolve(version, cache)
        (cache / ".complete").write_text(version)
    shipped = {_artifact(p.name) for p in pyspark_jars_dir().glob("*.jar")}
    jars = sorted(p for p in cache.glob("*.jar") if _artifact(p.name) not in shipped)
    if not any(p.name.startswith("spark-sql-kafka-0-10") for p in jars):
        raise JarResolutionError(f"no spark-sql-kafka-0-10 jar in {cache}")
    return jars


def main() -> int:
    try:
        jars = spark_kafka_jars(sys.argv[1] if len(sys.argv) > 1 else None)
    except JarResolutionError as exc:
        print(f"[spark-jars] {exc}", file=sys.stderr)
        return 1
    print("SPARK_KAFKA_JARS=" + ",".join(str(p) for p in jars))
    return 0


if __name__ == "__main__":
    sys.exit(main())
