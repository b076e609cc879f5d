#!/usr/bin/env python3
"""Spark's Kafka connector (spark-sql-kafka-0-10) for the Structured Streaming ack job.

    .venv/bin/python deploy/spark/jars.py      # prints SPARK_KAFKA_JARS=<comma-separated jar paths>

Resolves the connector matching the installed pyspark from Maven Central once, by
`mvn dependency:copy-dependencies` on deploy/spark/pom.xml (as deploy/local/services.py does for the
Kafka broker), and caches the jars per machine. Jars that pyspark already ships (Scala, Hadoop
client, slf4j, ...) are left out, so the session's classpath holds one copy of each. Standard
library only; run it with the interpreter that has pyspark installed.

The cache is filled through deploy/local/first_use.py: one resolver at a time per machine (the
others wait and reuse its result), in a private folder renamed into place once complete, so a killed
resolver never leaves a cache that looks usable. `make test` resolves it before the test workers start.

Environment: OUTBOX_SPARK_JARS_CACHE (default <OUTBOX_CACHE_DIR or ~/.cache/outbox-reaper>/spark-kafka-jars).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
POM = HERE / "pom.xml"
sys.path.insert(0, str(HERE.parent / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)


def cache_dir() -> Path:
    return Path(os.environ.get("OUTBOX_SPARK_JARS_CACHE") or first_use.cache_root() / "spark-kafka-jars")


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


def _resolve(version: str, folder: Path, pass_fds: tuple[int, ...]) -> None:
    _log(f"resolving spark-sql-kafka-0-10 {version} from Maven Central (into {folder}, renamed when complete)")
    args = ["-q", "-B", "-f", str(POM), "dependency:copy-dependencies", "-DincludeScope=runtime"]
    r = first_use.maven([*args, f"-Dspark.version={version}", f"-DoutputDirectory={folder}"], pass_fds=pass_fds)
    if r.returncode != 0:
        raise JarResolutionError(
            f"mvn could not resolve spark-sql-kafka-0-10 {version} (it must match the installed pyspark):\n"
            f"{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    if not any(folder.glob("spark-sql-kafka-0-10*.jar")):
        raise JarResolutionError(f"mvn resolved no spark-sql-kafka-0-10 jar into {folder}")


def spark_kafka_jars(version: str | None = None) -> list[Path]:
    """The connector's jars for `version` (default: the installed pyspark's), less those pyspark ships."""
    version = version or pyspark_version()
    digest = hashlib.sha256(POM.read_bytes() + version.encode()).hexdigest()[:16]
    cache = cache_dir() / f"{version}-{digest}"
    if not first_use.is_complete(cache):
        try:
            # Java 17 named first: Maven alone pulls in the distribution's default JRE, which may be
            # newer than the one Kafka and Spark are run on here (deploy/local/services_kafka.py).
            first_use.apt_install("openjdk-17-jre-headless", first_use.has_command("java"), log=_log)
            first_use.apt_install("maven", first_use.has_command("mvn"), log=_log)
        except first_use.FirstUseError as exc:
            raise JarResolutionError(f"mvn is required to resolve the Spark Kafka connector: {exc}") from None
        first_use.populate(cache, lambda folder, fds: _resolve(version, folder, fds))
    shipped = {_artifact(p.name) for p in pyspark_jars_dir().glob("*.jar")}
    jars = sorted(p for p in cache.glob("*.jar") if _artifact(p.name) not in shipped)
    if not any(p.name.startswith("spark-sql-kafka-0-10") for p in jars):
        raise JarResolutionError(f"no spark-sql-kafka-0-10 jar in {cache}")
    return jars


def _log(msg: str) -> None:
    print(f"[spark-jars] {msg}", file=sys.stderr, flush=True)


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
