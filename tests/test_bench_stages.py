"""bench.stages on the real services: each stage runs the harvester's own mark, purge and produce
call on a real outbox and Kafka topic, and the stages are set beside a whole harvest of the same rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench import stages
from tests.test_bench_help import REPO, _bench

STAGES = {
    "postgres_mark_purge",
    "postgres_select",
    "reaper_mark",
    "reaper_purge",
    "produce_call",
    "produce_call_bare",
    "librdkafka",
}


def test_every_stage_is_measured_and_set_beside_a_whole_harvest(pg_dsn: str, kafka_bootstrap: str) -> None:
    # A process of its own, as a reader runs it: the harvest sets the reaper's process settings
    done = subprocess.run(
        [sys.executable, "-m", "bench.stages", "--rows", "20000", "--dsn", pg_dsn, "--bootstrap", kafka_bootstrap],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["records"] == 20_000
    assert set(result["stages_us"]) == STAGES
    # CPU readings in clock ticks: on 20,000 rows a stage can read 0, never less
    assert all(v >= 0 for v in result["stages_us"].values()), result
    # The mark and purge emptied the outbox (measure raises otherwise), so the server worked
    assert result["stages_us"]["postgres_mark_purge"] > 0, result
    mine = result["stages_us"]
    assert result["reaper_stages_us"] == pytest.approx(
        mine["reaper_mark"] + mine["reaper_purge"] + mine["produce_call"] + mine["librdkafka"], abs=0.05
    )
    assert result["harvest"]["records_per_s"] > 0 and result["harvest"]["cpu_us_per_record"] > 0, result
    assert result["load_average_at_start"] >= 0
    assert result["stages_of_harvest"] == pytest.approx(
        result["reaper_stages_us"] / result["harvest"]["cpu_us_per_record"], rel=0.02
    )


def test_too_few_rows_for_one_mark_are_refused() -> None:
    with pytest.raises(ValueError, match="rows must be at least 5000, got 4999"):
        stages.measure("postgresql://nobody@127.0.0.1:1/none", "127.0.0.1:1", 4999)


@pytest.mark.parametrize("given", ["4999", "10000001", "1e9", "-5"])
def test_the_command_refuses_rows_out_of_range_by_name_before_any_service(given: str) -> None:
    done = _bench("stages", "--rows", given)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "--rows must be" in done.stderr and given in done.stderr, done.stderr[-2000:]
