"""Schema, table and outbox names from configuration: refused at load, naming the key and the value
as written, when they are not what the rule says (a trailing newline from a ConfigMap made from a
file), when a name derived from them would not be an identifier, or when two outbox entries name
one table; and refused the same way by the tracker where the library takes them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harvester import config
from tracker.errors import InvalidIdentifier
from tracker.schema import check_identifier


def refusal(overrides: dict) -> config.ConfigError:
    with pytest.raises(config.ConfigError) as err:
        config.load(None, environ={}, overrides=overrides)
    return err.value


# ------------------------------------------------------------------ a trailing newline


@given(name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,40}", fullmatch=True), tail=st.sampled_from(["\n", "\r\n", " "]))
def test_an_identifier_with_a_line_end_is_refused(name: str, tail: str) -> None:
    assert check_identifier(name, "table") == name
    with pytest.raises(InvalidIdentifier):
        check_identifier(name + tail, "table")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"database": {"schema": "reaper\n"}}, "database.schema"),
        ({"database": {"outbox_table": "outbox\n"}}, "database.outbox_table"),
        ({"harvester": {"outboxes": [{"name": "orders\n"}]}}, "harvester.outboxes[0].name"),
        ({"harvester": {"outboxes": [{"name": "orders", "table": "orders\n"}]}}, "harvester.outboxes[0].table"),
        ({"harvester": {"outboxes": [{"name": "orders", "schema": "billing\n"}]}}, "harvester.outboxes[0].schema"),
    ],
)
def test_the_configuration_refuses_a_trailing_newline(overrides: dict, key: str) -> None:
    err = refusal(overrides)
    assert err.key == key, str(err)
    assert "\\n'" in str(err), str(err)  # the value as written, its newline shown
