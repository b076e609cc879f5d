"""The inbox section is refused when its maintenance would leave the current time without a
partition: `reaper run` makes partitions `inbox.ahead` ahead every `inbox.interval`, so `ahead`
must cover the wait for the next run, and one more for a run that is skipped (a busy lock)."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harvester import config
from harvester.services.inbox import policy
from tracker.inbox import Inbox
from tracker.inbox.retention import maintain, partitions


@given(interval=st.floats(0.001, 86400), ahead=st.floats(0, 366 * 86400))
def test_ahead_is_taken_exactly_when_it_covers_two_maintenance_intervals(interval, ahead):
    overrides = {"inbox": {"interval": interval, "ahead": ahead}}
    if ahead >= 2 * interval:
        assert config.load(environ={}, overrides=overrides).inbox.ahead == ahead
    else:
        with pytest.raises(config.ConfigError) as err:
            config.load(environ={}, overrides=overrides)
        assert err.value.key == "inbox.ahead" and f"{ahead:.15g} must be at least 2 x inbox.interval" in str(err.value)


@pytest.mark.parametrize("ahead", [0, 30, 60, 119])
def test_an_ahead_the_next_run_would_outlive_is_refused_naming_it(ahead):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={}, overrides={"inbox": {"bucket": 60, "interval": 60, "ahead": ahead, "retention": 3600}})
    assert err.value.key == "inbox.ahead" and str(err.value).split("'inbox.ahead': ")[1].startswith(f"{ahead} ")


def test_without_the_maintenance_in_this_process_ahead_is_not_checked_against_its_interval():
    cfg = config.load(environ={}, overrides={"inbox": {"enabled": False, "interval": 60, "ahead": 0}})
    assert cfg.inbox.ahead == 0


def test_the_smallest_ahead_taken_covers_a_skipped_run(pg_dsn, schema):
    cfg = config.load(
        environ={},
        overrides={
            "database": {"dsn": pg_dsn, "schema": schema},
            "inbox": {"bucket": 60, "interval": 60, "ahead": 120, "retention": 3600},
        },
    )
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        # the schema's first partitions are whole days: drop them so this policy's are the ones
        for p in partitions(c, schema=schema):
            c.execute(f'DROP TABLE "{schema}"."{p.name}"')
            c.execute(f'DELETE FROM "{schema}".inbox_partition WHERE name = %s', [p.name])
        ran = dt.datetime.now(dt.UTC)
        maintain(c, schema=schema, policy=policy(cfg))
        upper = max(p.upper for p in partitions(c, schema=schema))
    # The next run comes inbox.interval later; if it is skipped, the one after that.
    assert upper > ran + dt.timedelta(seconds=2 * cfg.inbox.interval)
    with psycopg.connect(pg_dsn) as conn:
        assert Inbox("billing", schema=schema, registry=None).claim(conn, "m-1")
