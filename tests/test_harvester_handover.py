"""A SIGTERM'd leader of lanes hands over at once: it neither waits out the drain timeout nor
holds a lane's leadership while a batch it marked after the stop sits unproduced.

Real `reaper run` processes on the real Postgres and Kafka, with a backlog big enough that marks
are running when the signal lands. The drain timeout is set far above any honest drain, so the
test cannot pass by waiting it out.
"""

from __future__ import annotations

import json
import signal
import time

import psycopg
import pytest
from support.harness import env_for, make_config, outbox_count, wait_until
from support.json_log import unix_time
from support.reaper import ReaperProcess, stop_all

LANES = 3
DRAIN_TIMEOUT = 30.0
ROWS = 60_000


def _fill(pg_dsn: str, schema: str, topic: str, rows: int) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (topic, key, value) '
            "SELECT %s, convert_to('key-' || (i %% 200), 'UTF8'), convert_to('v' || i, 'UTF8') "
            "FROM generate_series(1, %s) AS i",
            [topic, rows],
        )


def _led(proc: ReaperProcess) -> set[int]:
    """The units `proc` leads according to its log."""
    state: dict[int, str] = {}
    for e in proc.events():
        if e.get("event", "").startswith("neli ") and isinstance(e.get("leader_partition"), int):
            state[e["leader_partition"]] = e["event"][5:]
    return {u for u, s in state.items() if s == "leader"}


@pytest.mark.xdist_group("reaper-failover")
@pytest.mark.parametrize("round_", range(3))
def test_sigterm_hands_every_lane_over_without_waiting_out_the_drain(
    pg_dsn, kafka_bootstrap, schema, topics, tmp_path, round_
):
    topic = topics("data", partitions=3)
    cfg = make_config(
        pg_dsn,
        schema,
        kafka_bootstrap,
        leader_topic=topics("leader", partitions=LANES),
        harvester={"drain_timeout": DRAIN_TIMEOUT, "session_timeout": 10.0, "heartbeat_timeout": 3.0},
    )
    env = {**env_for(cfg), "REAPER_HARVESTER__LANES": str(LANES)}
    a = ReaperProcess(env, tmp_path / "a.log")
    procs = [a]
    try:
        assert wait_until(lambda: _led(a) == set(range(LANES)), 60), a.log_path.read_text()[-3000:]
        b = ReaperProcess(env, tmp_path / "b.log")
        procs.append(b)
        assert wait_until(lambda: len(_led(b)) >= 1 and len(_led(a)) >= 1, 60), (_led(a), _led(b))
        _fill(pg_dsn, schema, topic, ROWS)
        # publishing is under way in A's lanes: marks are running when the signal lands
        assert wait_until(lambda: outbox_count(pg_dsn, schema) < ROWS - 5000, 60)
        lanes_of_a = _led(a)
        sent = time.time()
        a.signal(signal.SIGTERM)
        code = a.wait(DRAIN_TIMEOUT + 20)
        exited = time.time()
        # B takes A's lanes over and publishes the rest
        assert wait_until(lambda: outbox_count(pg_dsn, schema) == 0, 120)
        taken = {
            u: min(
                (
                    unix_time(e["timestamp"])
                    for e in b.events()
                    if e.get("event") == "neli leader"
                    and e.get("leader_partition") == u
                    and unix_time(e["timestamp"]) >= sent - 0.05
                ),
                default=None,
            )
            for u in lanes_of_a
        }
        events = a.events()
        drain_warnings = [e for e in events if e.get("event", "").startswith("drain timeout")]
        print(
            json.dumps(
                {
                    "sigterm_to_exit_s": round(exited - sent, 3),
                    "takeover_s": {u: None if t is None else round(t - sent, 3) for u, t in taken.items()},
                }
            )
        )
        assert code == 0, (code, drain_warnings)
        assert drain_warnings == []
        # it did not wait out the drain timeout (set far above any honest drain)
        assert exited - sent < DRAIN_TIMEOUT / 2, exited - sent
        stopped = [e for e in events if e.get("event") == "stopped"]
        assert stopped and stopped[-1]["drained"] is True and stopped[-1]["seconds"] < DRAIN_TIMEOUT / 2
        # every lane A led was taken over by B, well before A's drain timeout could have passed
        for u, t in taken.items():
            assert t is not None and t - sent < DRAIN_TIMEOUT / 2, (u, t, sent)
    finally:
        stop_all(procs)
