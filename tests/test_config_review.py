"""The configuration against hostile or mistaken input: secrets stay hidden in every DSN form libpq
reads and whatever a secret's type; YAML that expands, repeats a key or cannot be constructed, and
files that are not configuration, are configuration errors (exit 2) and never tracebacks; values
librdkafka or a thread's wait would refuse later are refused at load, naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from confluent_kafka import Consumer, Producer
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from psycopg.conninfo import conninfo_to_dict

from harvester import cli, config
from harvester.election.clients import heartbeat_producer_conf, leader_consumer_conf
from harvester.election.timeouts import election_client_defaults, silent_broker_defaults, silent_broker_wait_ms
from harvester.exit_codes import ExitCode

REPO = Path(__file__).resolve().parents[1]


def load_text(tmp_path: Path, text: str | bytes, **kwargs: Any) -> config.Config:
    path = tmp_path / "reaper.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return config.load(path, environ={}, **kwargs)


def refused(tmp_path: Path, text: str | bytes) -> config.ConfigError:
    with pytest.raises(config.ConfigError) as err:
        load_text(tmp_path, text)
    return err.value


# ------------------------------------------------------------------ secrets in every DSN form

# The secret starts and ends with a marker no other part of a generated DSN holds (they are lower
# case): a part of it left in the output shows as one of them.
SECRET = st.text(
    st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
        st.sampled_from(list("'\\\"@/?#&=:%, []!$")),
    ),
    max_size=12,
).map(lambda tail: f"SEC{tail}RET")
NAME = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
HOST = st.from_regex(r"[a-z][a-z0-9.-]{0,10}", fullmatch=True)
HOSTS = st.lists(
    st.tuples(HOST, st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}"))), min_size=1, max_size=3
)
QUERY = st.lists(st.sampled_from(["sslmode=prefer", "application_name=app", "connect_timeout=5"]), max_size=2)
# characters a URI may hold unencoded in its password (libpq reads the user info up to "@" or "/")
RAW_IN_URI = st.sampled_from(["", ":?#&=,[]' \"!$*+;", "?&=", " "])


@st.composite
def uri_with_userinfo(draw, secret: str) -> str:
    user = draw(st.one_of(st.just(""), NAME))
    hosts = ",".join(h + p for h, p in draw(HOSTS))
    db = draw(st.one_of(st.just(""), NAME.map(lambda n: f"/{n}")))
    query = draw(QUERY)
    tail = f"?{'&'.join(query)}" if query else ""
    scheme = draw(st.sampled_from(["postgresql://", "postgres://"]))
    return f"{scheme}{user}:{quote(secret, safe=draw(RAW_IN_URI))}@{hosts}{db}{tail}"


@st.composite
def uri_with_query_password(draw, secret: str) -> str:
    user = draw(st.one_of(st.just(""), NAME.map(lambda n: f"{n}@")))
    hosts = ",".join(h + p for h, p in draw(HOSTS))
    db = draw(NAME)
    name = draw(st.sampled_from(["password", "pass%77ord", "%70assword", "sslpassword"]))
    params = [*draw(QUERY), f"{name}={quote(secret, safe='')}"]
    params = draw(st.permutations(params))
    return f"postgresql://{user}{hosts}/{db}?{'&'.join(params)}"


def _quoted(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _escaped(value: str) -> str:
    return "".join("\\" + c if c in " \\'" else c for c in value)


@st.composite
def key_value(draw, secret: str) -> str:
    value = draw(st.sampled_from([_quoted, _escaped]))(secret)
    name = draw(st.sampled_from(["password", "sslpassword"]))
    pairs = [
        f"{name}{draw(st.sampled_from(['=', ' = ', '= ', ' =']))}{value}",
        f"host={draw(HOST)}",
        *draw(st.lists(st.sampled_from([f"dbname={draw(NAME)}", f"user={draw(NAME)}", "port=5432"]), max_size=2)),
    ]
    return " ".join(draw(st.permutations(pairs)))


@st.composite
def dsn_with_secret(draw) -> tuple[str, str]:
    secret = draw(SECRET)
    form = draw(st.sampled_from([uri_with_userinfo, uri_with_query_password, key_value]))
    dsn = draw(form(secret))
    try:
        parsed = conninfo_to_dict(dsn)
    except psycopg.Error:  # libpq 18 refuses spaces in a URI
        parsed = {}
    assume(secret in (parsed.get("password"), parsed.get("sslpassword")))  # libpq reads it as the password
    return dsn, secret


def assert_hidden(shown: str, secret: str) -> None:
    assert "SEC" not in shown and "RET" not in shown and secret not in shown, (shown, secret)


@settings(max_examples=600, deadline=None)
@given(dsn_with_secret())
def test_no_dsn_libpq_reads_a_password_from_shows_it_redacted(case):
    dsn, secret = case
    assert_hidden(config.redact_dsn(dsn), secret)
    assert_hidden(repr(config.redact("harvester.outboxes", [{"name": "a", "dsn": dsn}])), secret)
    if not dsn.startswith("postgres"):  # a key=value DSN quoted in a message
        assert_hidden(config.redact_dsn(f"could not connect with {dsn}: refused"), secret)


@settings(max_examples=200, deadline=None)
@given(dsn_with_secret())
def test_a_configured_dsn_never_reaches_the_redacted_view(case):
    dsn, secret = case
    cfg = config.load(
        environ={},
        overrides={"database": {"dsn": dsn}, "harvester": {"outboxes": [{"name": "a", "dsn": dsn}]}},
    )
    assert_hidden(repr(config.redacted(cfg)), secret)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://:SECRET1@127.0.0.1:1/x",  # no user name
        "host=h password='ab\\' SECRET2'",  # an escaped quote inside the quoted password
        "host=h password=ab\\ SECRET3 dbname=x",  # an escaped space in an unquoted one
        "postgresql://u@h/x?%70assword=SECRET5",  # a query parameter, its name %-encoded
    ],
)
def test_each_form_the_review_found_is_hidden(dsn: str):
    shown = config.redact_dsn(dsn)
    assert "SECRET" not in shown, shown


@pytest.mark.parametrize("value", [98765432101, 1.5, True, ["a", "b"], {"x": "y"}])
def test_a_secret_named_setting_is_hidden_whatever_its_type(value):
    shown = config.redact("kafka.client", {"sasl.password": value, "ssl.key.password": value})
    assert shown == {"sasl.password": "***", "ssl.key.password": "***"}


def test_a_numeric_kafka_password_is_hidden_in_the_redacted_view(tmp_path: Path):
    cfg = load_text(tmp_path, "kafka:\n  client:\n    sasl.password: 98765432101\n")
    assert cfg.kafka.client["sasl.password"] == 98765432101
    assert "98765432101" not in repr(config.redacted(cfg))


def test_the_starting_log_line_of_reaper_run_shows_no_password(tmp_path: Path):
    """The review's case, end to end: `reaper run` logs the configuration as it starts."""
    path = tmp_path / "leak.yaml"
    path.write_text(
        "database:\n"
        '  dsn: "postgresql://:LEAK1_emptyuser@127.0.0.1:1/x"\n'
        "  startup_timeout: 0\n"
        "kafka:\n"
        "  bootstrap_servers: 127.0.0.1:1\n"
        "  client:\n"
        "    sasl.password: 98765432101\n"
        "harvester:\n"
        "  outboxes:\n"
        "    - {name: a, dsn: \"host=127.0.0.1 port=1 password='ab\\\\' LEAK3_after_escaped_quote'\"}\n"
        "metrics: {enabled: false}\n"
        "logging: {format: json}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    done = subprocess.run(
        [sys.executable, "-m", "harvester.cli", "-c", str(path), "run"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    out = done.stdout + done.stderr
    starting = [json.loads(line) for line in out.splitlines() if '"starting"' in line]
    assert starting, out[-2000:]  # it did log its configuration
    for leaked in ("LEAK1_emptyuser", "98765432101", "LEAK3_after_escaped_quote"):
        assert leaked not in out, leaked


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:Pa%zzSECRET@127.0.0.1/x",  # libpq quotes the bad %-escape, password and all
        "host=h password=ab SECRETcd",  # ... and the word after an unquoted space
        "postgresql://app:SECRET%00x@h/x",
    ],
)
def test_a_dsn_libpq_cannot_read_is_refused_without_any_of_its_text(monkeypatch, capsys, dsn: str):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_DATABASE__DSN": dsn})
    assert err.value.key == "database.dsn" and "SECRET" not in str(err.value), err.value
    monkeypatch.setenv("REAPER_DATABASE__DSN", dsn)
    assert cli.main(["migrate", "--dry-run"]) == ExitCode.USAGE
    assert "SECRET" not in capsys.readouterr().err


def test_the_database_dsn_is_checked_when_every_outbox_has_its_own():
    # the ackers and the sweeper connect with database.dsn whatever harvester.outboxes says
    with pytest.raises(config.ConfigError) as err:
        config.load(
            environ={"REAPER_DATABASE__DSN": "postgresql://app:Pa%zzSECRET@h/x"},
            overrides={"harvester": {"outboxes": [{"name": "a", "dsn": "host=h dbname=x"}]}},
        )
    assert err.value.key == "database.dsn" and "SECRET" not in str(err.value)


def test_libpq_messages_that_quote_a_dsn_are_redacted():
    for message in (
        'connection is bad: invalid percent-encoded token: "Pa%zzSECRET"',
        'missing "=" after "SECRETcd" in connection info string',
        'invalid connection option "SECRET"',
    ):
        assert "SECRET" not in config.redact_dsn(message), message


# ------------------------------------------------------------------ YAML aliases and nesting


def laughs(levels: int) -> str:
    lines = ["kafka:", "  client:"]
    for i in range(levels):
        body = "[x,x,x,x,x,x,x,x,x,x]" if i == 0 else "[" + ",".join([f"*l{i - 1}"] * 10) + "]"
        lines.append(f"    k{i}: &l{i} {body}")
    return "\n".join(lines) + "\n"


def test_yaml_aliases_are_refused_at_once(tmp_path: Path):
    started = time.monotonic()
    err = refused(tmp_path, laughs(5))
    assert time.monotonic() - started < 5
    assert err.key == "--config" and "alias" in str(err) and "line 4" in str(err), err


def test_the_billion_laughs_file_of_the_review_exits_2_at_once(tmp_path: Path):
    path = tmp_path / "laughs.yaml"
    path.write_text(laughs(10))
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
    done = subprocess.run(
        [sys.executable, "-m", "harvester.cli", "-c", str(path), "migrate", "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == ExitCode.USAGE and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "alias" in done.stderr


@pytest.mark.parametrize("text", ["kafka:\n  client: &a {x: *a}\n", "harvester:\n  outboxes: &o [*o]\n"])
def test_a_self_referencing_alias_is_a_configuration_error(tmp_path: Path, text: str):
    err = refused(tmp_path, text)
    assert err.key == "--config" and "alias" in str(err), err


def test_deep_nesting_is_a_configuration_error(tmp_path: Path):
    err = refused(tmp_path, "harvester:\n  outboxes: " + "[" * 5000 + "]" * 5000 + "\n")
    assert err.key == "--config" and "nested" in str(err), err


def test_an_alias_in_an_environment_list_is_refused_too():
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_HARVESTER__OUTBOXES": "[&a {name: x}, *a]"})
    assert err.value.key == "harvester.outboxes" and "alias" in str(err.value)


def test_redact_is_safe_on_values_that_contain_themselves_or_expand():
    loop: dict[str, Any] = {"dsn": "postgresql://u:SECRET@h/x"}
    loop["self"] = loop
    shown = config.redact("kafka.client", loop)
    assert shown["self"] == "<recursive>" and "SECRET" not in repr(shown)
    wide: list[Any] = ["x"]
    for _ in range(60):  # 2**60 leaves, shared
        wide = [wide, wide]
    started = time.monotonic()
    assert len(repr(config.redact("kafka.client", wide))) < 200_000
    assert time.monotonic() - started < 5


def test_an_error_message_names_a_large_value_in_bounded_time_and_length():
    wide: list[Any] = ["x"]
    for _ in range(60):
        wide = [wide, wide]
    started = time.monotonic()
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={}, overrides={"database": {"schema": wide}})
    assert time.monotonic() - started < 5
    assert err.value.key == "database.schema" and len(str(err.value)) < 500, len(str(err.value))


# ------------------------------------------------------------------ files that are not configuration


@pytest.mark.parametrize(
    "content, says",
    [
        pytest.param(b"harvester:\n  mark_batch: " + b"9" * 5000 + b"\n", "too many digits at line 2", id="long-int"),
        pytest.param(b"database:\n  schema: \xff\xfe\n", "not UTF-8", id="not-utf8"),
        pytest.param(b"database:\n  schema: 2001-13-45\n", "not a valid date", id="bad-date"),
        pytest.param(b"database:\n  schema: x\x07\n", "not allowed in YAML", id="control-character"),
        pytest.param(b"# padding\n" * 120_000 + b"database:\n  schema: x\n", "larger than 1 MiB", id="over-1-MiB"),
    ],
)
def test_a_file_that_is_not_configuration_is_a_configuration_error(tmp_path: Path, content: bytes, says: str):
    err = refused(tmp_path, content)
    assert err.key == "--config" and says in str(err), err


def test_a_directory_is_a_configuration_error(tmp_path: Path, capsys):
    with pytest.raises(config.ConfigError) as err:
        config.load(tmp_path, environ={})
    assert err.value.key == "--config" and "directory" in str(err.value)
    assert cli.main(["-c", str(tmp_path), "migrate", "--dry-run"]) == ExitCode.USAGE


def test_a_long_integer_for_a_number_key_in_the_environment_is_a_configuration_error():
    for name in ("REAPER_HARVESTER__MARK_BATCH", "REAPER_SWEEPER__INTERVAL", "REAPER_DATABASE__SCHEMA"):
        with pytest.raises(config.ConfigError):
            config.load(environ={name: "9" * 5000})
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={}, overrides={"sweeper": {"interval": 10**400}})
    assert err.value.key == "sweeper.interval"


# ------------------------------------------------------------------ keys written twice


@pytest.mark.parametrize(
    "text, key, line",
    [
        (
            "database:\n  dsn: postgresql://app@db/prod\nlogging:\n  level: info\ndatabase:\n  schema: x\n",
            "database",
            5,
        ),
        ("database:\n  schema: a\n  schema: b\n", "schema", 3),
        ("kafka:\n  client: {client.id: a, client.id: b}\n", "client.id", 2),
        ("harvester:\n  outboxes:\n    - name: a\n      lanes: 1\n      lanes: 2\n", "lanes", 5),
    ],
)
def test_a_key_written_twice_is_a_configuration_error_naming_it_and_its_line(tmp_path: Path, text, key, line):
    err = refused(tmp_path, text)
    assert err.key == "--config" and f"found key {key!r} twice" in str(err) and f"line {line}," in str(err), err


# ------------------------------------------------------------------ what librdkafka would refuse later


@pytest.mark.parametrize(
    "environ, key",
    [
        ({"REAPER_HARVESTER__SESSION_TIMEOUT": "400"}, "harvester.session_timeout"),
        ({"REAPER_HARVESTER__SESSION_TIMEOUT": "1e9"}, "harvester.session_timeout"),
        ({"REAPER_KAFKA__CLIENT__NO_SUCH_PROP": "1"}, "kafka.client.no.such.prop"),
        ({"REAPER_KAFKA__CONSUMER__SESSION_TIMEOUT_MS": str(10**12)}, "kafka.consumer.session.timeout.ms"),
        ({"REAPER_KAFKA__CLIENT__SECURITY_PROTOCOL": "bogus"}, "kafka.client.security.protocol"),
        ({"REAPER_KAFKA__PRODUCER__ACKS": "1"}, "kafka.producer.acks"),  # the producer is idempotent
    ],
)
def test_kafka_settings_librdkafka_refuses_are_refused_at_load_naming_the_key(environ, key):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ=environ)
    assert err.value.key == key, err.value


def test_a_refused_kafka_secret_is_not_shown():
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_KAFKA__CLIENT__SSL_KEY_PASSWORD": "SECRET\0x"})
    assert err.value.key == "kafka.client.ssl.key.password" and "SECRET" not in str(err.value)


def test_librdkafka_checks_the_settings_at_load_without_reading_their_files():
    cfg = config.load(
        environ={
            "REAPER_KAFKA__CLIENT__SECURITY_PROTOCOL": "SASL_SSL",
            "REAPER_KAFKA__CLIENT__SASL_MECHANISM": "PLAIN",
            "REAPER_KAFKA__CLIENT__SASL_USERNAME": "svc",
            "REAPER_KAFKA__CLIENT__SASL_PASSWORD": "pw",
            "REAPER_KAFKA__CLIENT__SSL_CA_LOCATION": "/nonexistent/ca.pem",  # read only where the clients run
            "REAPER_KAFKA__PRODUCER__LINGER_MS": "20",
            "REAPER_KAFKA__CONSUMER__FETCH_MAX_BYTES": "1048576",
            "REAPER_HARVESTER__TRANSACTIONAL_ID": "reaper-txn",
        }
    )
    assert cfg.kafka.client["sasl.mechanism"] == "PLAIN"
    with pytest.raises(config.ConfigError) as err:  # ... while a value it refuses is refused
        config.load(
            environ={"REAPER_KAFKA__CLIENT__SSL_CA_LOCATION": "/nonexistent/ca.pem", "REAPER_KAFKA__CLIENT__ACKS": "x"}
        )
    assert err.value.key == "kafka.client.acks", err.value


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(st.floats(min_value=0.001, max_value=300), st.floats(min_value=300, max_value=1e12)),
    st.floats(min_value=0.001, max_value=1, exclude_max=True),
)
def test_every_accepted_election_timeout_makes_clients_librdkafka_accepts(session_timeout, share):
    """Whatever session and heartbeat timeouts load, librdkafka takes the election's and the data
    clients' settings derived from them (it refused socket.timeout.ms over 300 s, at `reaper run`)."""
    heartbeat_timeout = session_timeout * share
    try:
        cfg = config.load(
            environ={},
            overrides={"harvester": {"session_timeout": session_timeout, "heartbeat_timeout": heartbeat_timeout}},
        )
    except config.ConfigError as exc:
        assert exc.key in ("harvester.session_timeout", "harvester.heartbeat_timeout"), exc
        assume(False)
    h = cfg.harvester
    quiet = {"log_level": 0}
    waits = {**election_client_defaults(h.heartbeat_timeout, h.session_timeout), **quiet}
    wait_ms = silent_broker_wait_ms(h.heartbeat_timeout, h.session_timeout)
    Consumer({**leader_consumer_conf(waits, {}, "g", h.session_timeout), **quiet}).close()
    Producer({**heartbeat_producer_conf(waits, {}, h.session_timeout), **quiet}).flush(0)
    Producer({**silent_broker_defaults(wait_ms, producer=True), **quiet}).flush(0)


# ------------------------------------------------------------------ durations a wait can take


def seconds_keys() -> list[config.Setting]:
    return [
        s for s in config.settings() if s.kind is float and "second" in s.rule.doc and "per second" not in s.rule.doc
    ]


def test_every_duration_has_an_upper_bound_a_thread_can_wait():
    assert len(seconds_keys()) > 20
    unbounded = [s.dotted for s in seconds_keys() if s.rule.le is None or s.rule.le > threading.TIMEOUT_MAX]
    assert unbounded == []


def test_every_duration_past_its_bound_is_refused_naming_the_key():
    accepted = []
    for s in seconds_keys():
        try:
            config.load(environ={s.env: "1e13"})
            accepted.append(s.dotted)
        except config.ConfigError as err:
            assert err.key == s.dotted and "1e13" in str(err), err
    assert accepted == []


def count_keys() -> list[config.Setting]:
    return [s for s in config.settings() if s.kind is int]


def test_every_count_has_an_upper_bound_and_past_it_is_refused_naming_the_key():
    # A pool size, a worker count, a batch: each allocates (connections, threads, rows) in
    # proportion to its value, so none is unbounded.
    assert len(count_keys()) > 10
    accepted = []
    for s in count_keys():
        assert s.rule.le is not None, s.dotted
        past = str(int(s.rule.le) + 1)
        try:
            config.load(environ={s.env: past})
            accepted.append(s.dotted)
        except config.ConfigError as err:
            assert err.key == s.dotted and past in str(err), err
    assert accepted == []


# ------------------------------------------------------------------ environment variables


@pytest.mark.parametrize(
    "name",
    ["REAPER_DATABASE_SCHEMA", "REAPER_HARVESTER_LANES", "REAPER_KAFKA_CLIENT_SASL_PASSWORD", "REAPER_HTTP"],
)
def test_a_configuration_variable_with_one_underscore_is_refused_and_others_are_left_alone(name: str):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={name: "x"})
    assert err.value.key == name and "__" in str(err.value), err.value
    # the project's own test hooks, and what Kubernetes sets for services named reaper, reaper-http, ...
    environ = {
        "REAPER_FAULT_INJECTION": "{}",
        "REAPER_SERVICE_HOST": "10.0.0.1",
        "REAPER_PORT": "tcp://10.0.0.1:9400",
        "REAPER_HTTP_SERVICE_HOST": "10.0.0.2",
        "REAPER_HTTP_SERVICE_PORT": "8400",
        "REAPER_HTTP_PORT": "tcp://10.0.0.2:8400",
        "REAPER_HTTP_PORT_8400_TCP": "tcp://10.0.0.2:8400",
        "REAPER_HTTP_PORT_8400_TCP_ADDR": "10.0.0.2",
        "REAPER_METRICS_SERVICE_PORT_METRICS": "9400",
    }
    assert config.load(environ=environ) == config.load(environ={})


@pytest.mark.parametrize(
    "name",
    ["REAPER_KAFKA__CLIENT__", "REAPER_DATABASE__", "REAPER___DSN"],
)
def test_a_variable_that_names_no_key_is_refused(name: str):
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={name: "1"})
    assert err.value.key == name, err.value


def test_two_variables_for_one_key_are_refused():
    with pytest.raises(config.ConfigError) as err:
        config.load(environ={"REAPER_DATABASE__SCHEMA": "a", "REAPER_database__schema": "b"})
    assert "database.schema" in str(err.value)


@pytest.mark.parametrize("topic", [".", "..", "a b", "t" * 250])
def test_a_configured_topic_kafka_refuses_is_refused_as_the_library_refuses_it(topic):
    from tracker.core.validate import check_topic
    from tracker.errors import InvalidValue

    with pytest.raises(InvalidValue):
        check_topic(topic)
    with pytest.raises(config.ConfigError, match="harvester.default_completion_topic"):
        config.load(None, environ={}, overrides={"harvester": {"default_completion_topic": topic}})
