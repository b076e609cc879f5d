"""Fetch the PostgreSQL JDBC driver (pom.xml beside this file) into the machine's cache, once.

`mvn dependency:copy-dependencies` resolves it from Maven Central, as deploy/local/services.py does
for Kafka's jars, into a private folder renamed into place when complete (deploy/local/first_use.py):
two installers at once, or one that is killed, never leave a half-filled folder that looks usable.
The folder is named by a digest of the pom: a changed pom gets a new one. Installs Debian's JDK
(`java File.java` needs its compiler) and Maven when missing. Used by the documentation's Java
examples (tests/test_docs_examples.py), resolved once by `make caches`, and runnable by hand:
`python3 tests/clients/jvm/install.py` prints the classpath.

Environment: OUTBOX_JDBC_CLIENT_CACHE (default <OUTBOX_CACHE_DIR or ~/.cache/outbox-reaper>/jdbc-client).
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
POM = HERE / "pom.xml"
sys.path.insert(0, str(REPO / "deploy" / "local"))
import first_use  # noqa: E402  (deploy/local/first_use.py, standard library only)


def cache_dir() -> Path:
    return Path(os.environ.get("OUTBOX_JDBC_CLIENT_CACHE") or first_use.cache_root() / "jdbc-client")


def _resolve(folder: Path, pass_fds: tuple[int, ...]) -> None:
    args = ["-q", "-B", "-f", str(POM), "dependency:copy-dependencies", "-DincludeScope=runtime"]
    r = first_use.maven([*args, f"-DoutputDirectory={folder}"], pass_fds=pass_fds)
    if r.returncode != 0:
        raise RuntimeError(f"mvn could not resolve the PostgreSQL JDBC driver:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    if not any(folder.glob("postgresql-*.jar")):
        raise RuntimeError(f"mvn resolved no postgresql-*.jar into {folder}")


def install() -> str:
    """Return the classpath (a folder's jars, `<folder>/*`) holding the driver, fetching it first if needed."""
    first_use.apt_install("openjdk-17-jdk-headless", first_use.has_command("javac"))
    target = cache_dir() / hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
    if not first_use.is_complete(target):
        first_use.apt_install("maven", first_use.has_command("mvn"))
        first_use.populate(target, _resolve)
    return f"{target}/*"


if __name__ == "__main__":
    try:
        print(install())
    except RuntimeError as exc:  # first_use.FirstUseError too
        print(exc, file=sys.stderr)
        sys.exit(1)
