"""The configuration schema (harvester/config_keys.py) as properties: every key, whatever its rule.

A value outside a key's bounds, a non-integral number for an integer key and a boolean for a
number are refused, from the YAML file and from the environment, with a ConfigError naming the key
and the value as written; every valid value of every key survives YAML -> configuration ->
the generated reference -> configuration; secrets never reach the redacted view.
"""

from __future__ import annotations

import importlib.util
import math
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, reject, settings
from hypothesis import strategies as st
from support.scripts import load_script

from harvester import config
from harvester.exit_codes import ExitCode
from tracker.core.validate import TOPIC_CHARS

REPO = Path(__file__).resolve().parents[1]
SETTINGS = config.settings()
NUMERIC = [s for s in SETTINGS if s.kind in (int, float)]
BOUNDED = [s for s in NUMERIC if (s.rule.gt, s.rule.ge, s.rule.le) != (None, None, None)]
INTEGER = [s for s in NUMERIC if s.kind is int]


def reference_module():
    return load_script(REPO / "deploy" / "config_reference.py", "config_reference")


REFERENCE = reference_module()


def load_yaml(text: str) -> config.Config:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "reaper.yaml"
        path.write_text(text)
        return config.load(path, environ={})


def one_key(s: config.Setting, value: Any) -> str:
    return yaml.safe_dump({s.section: {s.name: value}})


def refused(load, s: config.Setting, shown: str) -> str:
    with pytest.raises(config.ConfigError) as err:
        load()
    assert err.value.key == s.dotted, err.value
    assert str(err.value).startswith(f"configuration key {s.dotted!r}: ")
    assert shown in str(err.value), (shown, str(err.value))
    return str(err.value)


def env_text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


# ------------------------------------------------------------------ values a key refuses


@st.composite
def out_of_bounds(draw) -> tuple[config.Setting, Any]:
    s = draw(st.sampled_from(BOUNDED))
    r, sides = s.rule, []
    if s.kind is int:
        if r.gt is not None:
            sides.append(st.integers(max_value=int(r.gt)))
        if r.ge is not None:
            sides.append(st.integers(max_value=int(r.ge) - 1))
        if r.le is not None:
            sides.append(st.integers(min_value=int(r.le) + 1))
    else:
        finite = {"allow_nan": False, "allow_infinity": False}
        if r.gt is not None:
            sides.append(st.floats(max_value=r.gt, **finite))
        if r.ge is not None:
            sides.append(st.floats(max_value=r.ge, exclude_max=True, **finite))
        if r.le is not None:
            sides.append(st.floats(min_value=r.le, exclude_min=True, **finite))
    return s, draw(st.one_of(sides))


@settings(max_examples=300, deadline=None)
@given(out_of_bounds())
def test_a_number_outside_its_bounds_is_refused_naming_key_and_value(case):
    s, value = case
    refused(lambda: load_yaml(one_key(s, value)), s, f"got {value!r}")
    text = env_text(value)
    refused(lambda: config.load(environ={s.env: text}), s, f"got {text!r}")
    refused(lambda: config.load(environ={}, overrides={s.section: {s.name: value}}), s, f"got {value!r}")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(INTEGER), st.floats().filter(lambda v: not v.is_integer()))
def test_a_non_integral_number_for_an_integer_key_is_refused_naming_key_and_value(s, value):
    message = refused(lambda: load_yaml(one_key(s, value)), s, repr(value))
    assert "expected int" in message
    text = env_text(value)
    refused(lambda: config.load(environ={s.env: text}), s, repr(text))


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(NUMERIC), st.booleans())
def test_a_boolean_is_not_a_number(s, value):
    refused(lambda: load_yaml(one_key(s, value)), s, repr(value))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([s for s in NUMERIC if s.kind is float]), st.sampled_from(["nan", "inf", "-inf"]))
def test_a_number_key_refuses_nan_and_infinity(s, text):
    refused(lambda: config.load(environ={s.env: text}), s, repr(text))
    refused(lambda: load_yaml(one_key(s, float(text))), s, repr(float(text)))


def test_integer_keys_keep_accepting_integral_text_and_numbers():
    """As before the schema: the environment's "2000" is 2000, and so is YAML's 2000.0."""
    cfg = config.load(environ={"REAPER_HARVESTER__MARK_BATCH": "2000", "REAPER_SWEEPER__CHUNK": " 7 "})
    assert (cfg.harvester.mark_batch, cfg.sweeper.chunk) == (2000, 7)
    assert load_yaml("harvester:\n  mark_batch: 2000.0\n").harvester.mark_batch == 2000
    assert load_yaml("harvester:\n  mark_batch: '2000'\n").harvester.mark_batch == 2000
    assert config.load(environ={"REAPER_HARVESTER__MIN_POLL_INTERVAL": "1"}).harvester.min_poll_interval == 1.0


# ------------------------------------------------------------------ values a key accepts

IDENTIFIER = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,30}", fullmatch=True)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=30)
# librdkafka settings and values it takes (it checks kafka.* at load: a made-up name is refused)
KAFKA_SETTING = st.one_of(
    st.tuples(
        st.sampled_from(["client.id", "client.rack", "sasl.username", "sasl.password"]),
        TEXT.filter(lambda t: "\0" not in t),
    ),
    st.tuples(st.just("socket.send.buffer.bytes"), st.integers(0, 100_000_000)),
    st.tuples(st.sampled_from(["socket.nagle.disable", "socket.keepalive.enable"]), st.booleans()),
)
OUTBOX = st.fixed_dictionaries(
    {"name": st.from_regex(r"[A-Za-z0-9_-]{1,40}", fullmatch=True)},
    optional={
        "dsn": TEXT.filter(bool),
        "schema": IDENTIFIER,
        "table": IDENTIFIER,
        "lanes": st.integers(1, 4),
    },
)


def valid(s: config.Setting) -> st.SearchStrategy[Any]:
    r = s.rule
    if s.kind is bool:
        return st.booleans()
    if s.kind is int:
        low = int(r.gt) + 1 if r.gt is not None else (int(r.ge) if r.ge is not None else None)
        return st.integers(min_value=low, max_value=None if r.le is None else int(r.le))
    if s.kind is float:
        low = r.gt if r.gt is not None else r.ge
        return st.floats(
            min_value=low, max_value=r.le, exclude_min=r.gt is not None, allow_nan=False, allow_infinity=False
        )
    if s.kind is dict:
        return st.lists(KAFKA_SETTING, max_size=3, unique_by=lambda kv: kv[0]).map(dict)
    if s.kind is list:
        return st.lists(OUTBOX, max_size=3, unique_by=lambda e: e["name"])
    if r.choices:
        return st.sampled_from(r.choices)
    if r.check is not None and r.check.identifier:
        return IDENTIFIER
    if r.check is not None:
        if r.check.accepts is not None:  # a rule stated as a predicate: drawn from its alphabet
            pattern = st.from_regex(TOPIC_CHARS, fullmatch=True).filter(r.check.accepts)
        else:
            pattern = st.from_regex(r.check.regex, fullmatch=True)
        return st.one_of(st.just(""), pattern) if r.check.optional else pattern
    return TEXT


@st.composite
def one_valid_key(draw) -> tuple[config.Setting, Any]:
    s = draw(st.sampled_from(SETTINGS))
    return s, draw(valid(s))


MARKDOWN = REFERENCE.reference_markdown().splitlines()


@settings(max_examples=150, deadline=None)
@given(one_valid_key())
def test_every_key_round_trips_yaml_config_and_reference(case):
    s, value = case
    candidate = config.Config()
    setattr(getattr(candidate, s.section), s.name, value)
    try:
        config._check_relations(candidate)  # a valid value may still clash with another key's default
    except config.ConfigError:
        reject()
    cfg = load_yaml(one_key(s, value))
    got = getattr(getattr(cfg, s.section), s.name)
    assert got == value and type(got) is s.kind, (got, value)
    # the generated reference writes every key with its value; read back, it is the same configuration
    assert load_yaml(REFERENCE.example_yaml(cfg)) == cfg
    row = next(line for line in MARKDOWN if line.startswith(f"| `{s.dotted}` |"))
    assert f"`{s.env}" in row and s.rule.doc in row


@settings(max_examples=200, deadline=None)
@given(one_valid_key())
def test_every_key_can_be_set_from_its_environment_variable(case):
    s, value = case
    if s.kind in (dict, list) or (s.kind is str and (value != value.strip() or not value.isprintable())):
        reject()  # mappings take one variable per entry; the environment carries printable text
    text = value if isinstance(value, str) else yaml.safe_dump(value).removesuffix("...\n").strip()
    candidate = config.Config()
    setattr(getattr(candidate, s.section), s.name, value)
    try:
        config._check_relations(candidate)
    except config.ConfigError:
        reject()
    got = getattr(getattr(config.load(environ={s.env: text}), s.section), s.name)
    assert got == value or (isinstance(value, float) and math.isclose(got, value)), (got, value)


# ------------------------------------------------------------------ secrets


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([s for s in SETTINGS if s.rule.secret]), st.from_regex(r"[A-Za-z0-9]{8,20}", fullmatch=True))
def test_secret_keys_never_reach_the_redacted_view(s, secret):
    cfg = config.load(environ={}, overrides={s.section: {s.name: secret}})
    assert secret not in repr(config.redacted(cfg))
    assert config.redacted(cfg)[s.section][s.name] == "***"


def test_passwords_in_every_dsn_are_redacted():
    cfg = config.load(
        environ={"REAPER_KAFKA__CLIENT__SASL_PASSWORD": "kafka-pw"},
        overrides={
            "database": {"dsn": "postgresql://app:db-pw@h/outbox"},
            "harvester": {"outboxes": [{"name": "a", "dsn": "host=h password=other-pw dbname=x"}]},
        },
    )
    shown = repr(config.redacted(cfg))
    assert not re.search("db-pw|other-pw|kafka-pw", shown), shown
    assert config.redacted(cfg)["database"]["dsn"] == "postgresql://app:***@h/outbox"


def test_a_refused_secret_is_not_echoed():
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={}, overrides={"http": {"tokens": ["tok-s3cret"]}})
    assert err.value.key == "http.tokens" and "tok-s3cret" not in str(err.value)


# ------------------------------------------------------------------ exit codes


def test_exit_codes_are_defined_once():
    pattern = re.compile(r"^\s*EXIT_[A-Z_]+\s*[,=]", re.M)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "harvester").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_the_exit_code_page_is_the_enum():
    page = (REPO / "docs" / "reference" / "exit-codes.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| (.*) \|$", page, re.M)
    assert [(int(code), name, meaning) for code, name, meaning in rows] == [
        (c.value, c.name, c.meaning) for c in ExitCode
    ]
    for text in [(REPO / "README.md").read_text(), *(p.read_text() for p in (REPO / "docs").rglob("*.md"))]:
        assert "| exit code | meaning |" not in text, "a hand-written exit-code table"
