"""deploy/spark/fan_out_job.py: it splits and orders the rows by the columns it writes only (an
input may hold columns Spark cannot order, such as a map), and a submission with the run key of an
earlier one and another --partitions is refused (exit 2, naming --partitions) before it writes."""

from __future__ import annotations

import importlib.util

import psycopg
import pytest
from support.spark import REPO

from tracker import spark as tspark

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

JOB = REPO / "deploy" / "spark" / "fan_out_job.py"


def _run_job(argv: list[str]) -> int:
    """main() of the job in a local session of its own (the job stops the session it finds)."""
    spec = importlib.util.spec_from_file_location("fan_out_job", JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    session = tspark.local_session("local[2]", app_name="tracker-fan-out-job-tests")
    try:
        return job.main(argv)
    finally:
        session.stop()


def _write_input(tmp_path) -> str:
    path = str(tmp_path / "items.parquet")
    session = tspark.local_session("local[2]", app_name="tracker-fan-out-job-input")
    try:
        session.createDataFrame(
            [(b"v%d" % i, f"k{i % 3}", {"color": "red" if i % 2 else "blue"}) for i in range(40)],
            "value binary, key string, attrs map<string,string>",
        ).write.parquet(path)
    finally:
        session.stop()
    return path


def _outbox(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as c:
        return c.execute(
            f'SELECT count(*), count(DISTINCT value), count(key) FROM "{schema}".outbox WHERE topic = %s', ["work"]
        ).fetchone()


def test_an_input_with_a_map_column_fans_out_and_another_partition_count_is_refused(pg_dsn, schema, tmp_path, capsys):
    path = _write_input(tmp_path)
    common = ["--input", path, "--dsn", pg_dsn, "--schema", schema, "--topic", "work", "--run-key", "maps-1"]
    assert _run_job([*common, "--key-col", "key", "--partitions", "3"]) == 0
    assert _outbox(pg_dsn, schema) == (40, 40, 40)
    capsys.readouterr()
    assert _run_job([*common, "--key-col", "key", "--partitions", "5"]) == 2
    err = capsys.readouterr().err
    assert "--partitions 5: --run-key 'maps-1' was first submitted with --partitions 3" in err
    assert _outbox(pg_dsn, schema) == (40, 40, 40)
    # the same submission again: a finished job writes nothing
    assert _run_job([*common, "--key-col", "key", "--partitions", "3"]) == 0
    assert _outbox(pg_dsn, schema) == (40, 40, 40)
