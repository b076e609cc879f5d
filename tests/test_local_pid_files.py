"""The local services' pid files (deploy/local/services_base.owned_pid): a pid file names a service
only while that very process runs, with this layout's configuration on its command line. A stale
file whose number another program (or another checkout's service of the same kind) now has must
name nothing: `down` would signal it, and `up` would wait on it for good."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "local"))
from services_base import owned_pid  # noqa: E402


def _spawn(*argv: str) -> subprocess.Popen:
    p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    # Popen returns at exec's point of no return; the new command line is readable a moment later
    # (until then it reads empty, which owned_pid takes as a JVM re-executing itself: ours)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not Path(f"/proc/{p.pid}/cmdline").read_bytes():
        time.sleep(0.001)
    return p


def test_a_pid_file_names_only_the_process_it_was_written_for(tmp_path):
    ours = tmp_path / "server.properties"
    ours.write_text("")
    pidfile = tmp_path / "kafka.pid"
    # stand-ins: a "broker" of this layout, one of another layout, and an unrelated program
    mine = _spawn(sys.executable, "-c", "import time; time.sleep(60)", "kafka.Kafka", str(ours))
    other = _spawn(sys.executable, "-c", "import time; time.sleep(60)", "kafka.Kafka", "/elsewhere/server.properties")
    unrelated = _spawn("sleep", "60")
    try:
        pidfile.write_text(str(mine.pid))
        assert owned_pid(pidfile, "kafka.Kafka", str(ours)) == mine.pid
        for stranger in (other, unrelated):
            pidfile.write_text(str(stranger.pid))
            assert owned_pid(pidfile, "kafka.Kafka", str(ours)) is None, stranger.args
        for garbled in ("", "\n", "x", "-1", "0"):  # killed while it was written, or worse
            pidfile.write_text(garbled)
            assert owned_pid(pidfile, "kafka.Kafka", str(ours)) is None, repr(garbled)
        pidfile.unlink()
        assert owned_pid(pidfile, "kafka.Kafka", str(ours)) is None
    finally:
        for p in (mine, other, unrelated):
            p.kill()
            p.wait()


def test_a_process_that_is_gone_or_a_zombie_is_not_running(tmp_path):
    pidfile = tmp_path / "x.pid"
    zombie = subprocess.Popen(["sleep", "0"])  # exits at once; not reaped until wait(): a zombie meanwhile
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "Z" not in Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1][:3]:
        time.sleep(0.01)
    pidfile.write_text(str(zombie.pid))
    assert owned_pid(pidfile, "sleep") is None
    zombie.wait()
    assert owned_pid(pidfile, "sleep") is None  # reaped: gone


def test_a_spark_pid_file_names_only_this_checkouts_spark(tmp_path):
    import spark_cluster

    home = spark_cluster.spark_home()
    assert home is not None, "pyspark is installed with the test extras"
    pidfile = tmp_path / "master.pid"
    mine = _spawn(sys.executable, "-c", "import time; time.sleep(60)", "-cp", f"{home}/jars/*", "deploy.master.Master")
    # another checkout's master (its own pyspark), and a Spark worker of this one, are not our master
    other = _spawn(
        sys.executable, "-c", "import time; time.sleep(60)", "-cp", "/elsewhere/jars/*", "deploy.master.Master"
    )
    worker = _spawn(
        sys.executable, "-c", "import time; time.sleep(60)", "-cp", f"{home}/jars/*", "deploy.worker.Worker"
    )
    try:
        pidfile.write_text(str(mine.pid))
        assert spark_cluster._alive(pidfile, "deploy.master.Master") == mine.pid
        for stranger in (other, worker):
            pidfile.write_text(str(stranger.pid))
            assert spark_cluster._alive(pidfile, "deploy.master.Master") is None, stranger.args
    finally:
        for p in (mine, other, worker):
            p.kill()
            p.wait()
