"""The election's and the publishing state's log lines of a harvest unit name it as every other
line of it does (its name, not its leader-topic partition) and carry the id it marks rows with, not
another one, with several units led by one process."""

from __future__ import annotations

import uuid

from support.harness import make_config, wait_until
from support.json_log import events, json_log

from harvester import logs
from harvester.units import Harvester

LANES = 3


def test_each_units_leadership_lines_carry_its_name_and_the_id_it_marks_with(pg_dsn, kafka_bootstrap, schema, topics):
    cfg = make_config(
        pg_dsn, schema, kafka_bootstrap, leader_topic=topics("leader", partitions=LANES), harvester={"lanes": LANES}
    )
    with json_log() as out:
        h = Harvester(cfg).start()
        try:
            assert wait_until(lambda: len(h.leading_units()) == LANES, 30), h.leading_units()
            assert wait_until(lambda: all(u.current_id is not None for u in h.units), 10)
            marking = {u.spec.name: str(u.current_id) for u in h.units}
        finally:
            h.stop(5)
        logged = events(out)
    names = {f"default.{lane}": lane for lane in range(LANES)}
    assert set(marking) == set(names)
    for name, lane in names.items():
        # the first leadership of each unit (a fence in between would start another)
        led = next(e for e in logged if e["event"] == "neli leader" and e.get("leader_partition") == lane)
        state = next(e for e in logged if e["event"] == "publishing state" and e.get("unit") == name)
        head = next(e for e in logged if e["event"] == "leading: marking from the head" and e.get("unit") == name)
        assert led["unit"] == name, led
        assert state["state"] == "leader", state
        assert led["leader_id"] == state["leader_id"] == head["leader_id"], (led, state, head)
        assert head["leader_id"] == marking[name], (head, marking)
    assert len(set(marking.values())) == LANES


def test_a_line_naming_a_leadership_by_its_acquisition_carries_the_id_marked_with_now():
    """After a remark the unit marks with a new id: a line of the election that names the
    leadership by its acquisition id (a fence) carries the id rows are marked with."""
    acquired, remarked, other = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with json_log() as out:
        log = logs.get("reaper.test")
        logs.unit_leaders.set("orders.1", None, 1)
        try:
            log.info("neli leader", unit=1, leader_id=str(acquired))
            logs.unit_leaders.set("orders.1", acquired, 1, acquisition=acquired)
            logs.unit_leaders.set("orders.1", remarked, 1, acquisition=acquired)
            log.info("fencing", unit=1, leader_id=str(acquired))
            log.info("a later acquisition", unit=1, leader_id=str(other))
            log.info("no unit of this process", unit=7, leader_id=str(other))
            logs.unit_leaders.set("orders.1", None, 1)
            log.info("not leading", unit=1)
        finally:
            logs.unit_leaders.forget("orders.1")
        logged = events(out)
    got = [(e["event"], e["unit"], e.get("leader_partition"), e["leader_id"]) for e in logged]
    assert got == [
        ("neli leader", "orders.1", 1, str(acquired)),
        ("fencing", "orders.1", 1, str(remarked)),
        ("a later acquisition", "orders.1", 1, str(other)),
        ("no unit of this process", 7, None, str(other)),
        ("not leading", "orders.1", 1, None),
    ]
