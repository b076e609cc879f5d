"""The configuration as an operator meets it: mistakes in the file or the environment fail at start
with exit code 2, name the key they concern, and never echo a secret."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harvester import cli, config
from harvester.exit_codes import ExitCode


@pytest.mark.parametrize(
    "text, secret",
    [
        ('database:\n  dsn: "postgresql://app:db-s3cret@h/outbox\n  schema: x\n', "db-s3cret"),
        ("kafka:\n  client:\n    sasl.password: kafka-s3cret: x\n", "kafka-s3cret"),
        ("http:\n  tokens: tok-s3cret\n  port: [8400\n", "tok-s3cret"),
    ],
)
def test_a_yaml_syntax_error_names_the_place_but_not_the_line(tmp_path: Path, text: str, secret: str):
    path = tmp_path / "reaper.yaml"
    path.write_text(text)
    with pytest.raises(config.ConfigError) as err:
        config.load(path, environ={})
    assert err.value.key == "--config"
    assert "line " in str(err.value) and "column " in str(err.value), err.value
    assert secret not in str(err.value), err.value


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"database": {"dsn": "postgresql://app:db-s3cret@[bad/outbox"}}, "database.dsn"),
        ({"database": {"dsn": "nonsense password=db-s3cret"}}, "database.dsn"),
        (
            {"harvester": {"outboxes": [{"name": "a", "dsn": "postgresql://app:db-s3cret@[bad/outbox"}]}},
            "harvester.outboxes[0].dsn",
        ),
    ],
)
def test_a_malformed_dsn_is_a_configuration_error_without_its_password(overrides, key):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={}, overrides=overrides)
    assert err.value.key == key, err.value
    assert "db-s3cret" not in str(err.value), err.value


@pytest.mark.parametrize("command", [["migrate", "--dry-run"], ["outbox", "status"], ["dead", "list"], ["run"]])
def test_every_command_exits_2_for_a_malformed_dsn(monkeypatch, capsys, command):
    monkeypatch.setenv("REAPER_DATABASE__DSN", "postgresql://app:db-s3cret@[bad/outbox")
    assert cli.main(command) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "database.dsn" in err and "db-s3cret" not in err, err


def test_an_empty_database_dsn_is_named_as_written():
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_DATABASE__DSN": ""})
    assert err.value.key == "database.dsn", err.value


@pytest.mark.parametrize("value", ["-1", "0"])
def test_acker_poll_timeout_must_be_positive(value):
    # confluent_kafka waits forever on a negative timeout: the acker would not see SIGTERM, `reaper
    # run` would give up on it after the drain and leave its consumer in the group; 0 spins.
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_ACKER__POLL_TIMEOUT": value})
    assert err.value.key == "acker.poll_timeout" and repr(value) in str(err.value)


def test_a_nested_kafka_mapping_is_refused_at_load_naming_the_dotted_key(tmp_path: Path):
    # `sasl: {password: ...}` is how YAML would spell sasl.password; librdkafka knows only the dotted
    # names, so it used to pass the configuration and fail when the first client was made (exit 1).
    path = tmp_path / "reaper.yaml"
    path.write_text("kafka:\n  client:\n    sasl:\n      password: kafka-s3cret\n")
    with pytest.raises(config.ConfigError) as err:
        config.load(path, environ={})
    assert err.value.key == "kafka.client.sasl", err.value
    assert "sasl.password" in str(err.value) and "kafka-s3cret" not in str(err.value), err.value


@pytest.mark.parametrize("value", ["-1", "0.5", "3601", "soon"])
def test_step_down_after_is_0_or_from_1_to_3600_seconds(value):
    # Below a second, the marks a database restart fails for a moment would hand leadership over.
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_HARVESTER__STEP_DOWN_AFTER": value})
    assert err.value.key == "harvester.step_down_after" and value in str(err.value), err.value


@pytest.mark.parametrize("value, expected", [("0", 0.0), ("1", 1.0), ("2.5", 2.5), ("3600", 3600.0)])
def test_step_down_after_accepts_0_for_never_and_at_least_a_second(value, expected):
    assert config.load(environ={"REAPER_HARVESTER__STEP_DOWN_AFTER": value}).harvester.step_down_after == expected
    assert config.load(environ={}).harvester.step_down_after == 10.0


@settings(max_examples=50, deadline=None)
@given(
    section=st.sampled_from(sorted(config.sections())),
    name=st.from_regex(r"[A-Z][A-Z0-9]{0,12}(_[A-Z0-9]{1,6}){0,2}", fullmatch=True),
)
def test_an_unknown_key_from_the_environment_names_the_variable_as_written(section: str, name: str):
    assume(name.lower() not in config.sections()[section])
    variable = f"REAPER_{section.upper()}__{name}"
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={variable: "6"})
    assert err.value.key == variable and f"{section}.{name.lower()}" in err.value.problem, err.value


def test_a_misspelled_variable_is_named_with_the_one_meant(capsys, monkeypatch):
    monkeypatch.setenv("REAPER_HARVESTER__SESION_TIMEOUT", "6")
    assert cli.main(["migrate", "--dry-run"]) == ExitCode.USAGE
    err = capsys.readouterr().err
    assert "'REAPER_HARVESTER__SESION_TIMEOUT': is read as harvester.sesion_timeout, an unknown key" in err, err
    assert "did you mean REAPER_HARVESTER__SESSION_TIMEOUT?" in err, err
    with pytest.raises(config.ConfigError) as in_file:  # the file's key is named as the file writes it
        config.load(environ={}, overrides={"harvester": {"sesion_timeout": 6}})
    assert in_file.value.key == "harvester.sesion_timeout"
