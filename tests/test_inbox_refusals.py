"""The inbox refuses bad input before anything is written, with a typed error naming the value
as written and its own SQLSTATE, and the caller's transaction goes on: message ids, consumer
names of any type, isolation levels it cannot keep."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracker import inbox
from tracker.errors import SQLSTATES, InvalidArgument, InvalidIdentifier, InvalidValue
from tracker.inbox import Inbox, IsolationNotSupported


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    value=st.one_of(
        st.text(max_size=260),
        st.binary(max_size=300),
        st.integers(),
        st.none(),
        st.lists(st.text(max_size=3), max_size=2),
    )
)
def test_a_message_id_is_checked_before_anything_is_written(pg_dsn, schema, value):
    """Any value: accepted (1 to 200 characters of text, UTF-8 bytes) and recorded, or refused
    with a typed error naming it, the caller's transaction unchanged and usable."""
    box = Inbox("c", schema=schema)
    text = value.decode("utf-8", "strict") if isinstance(value, bytes) and _utf8(value) else value
    valid = isinstance(text, str) and 1 <= len(text) <= 200 and "\x00" not in text
    with psycopg.connect(pg_dsn) as conn:
        if valid:
            assert box.claim(conn, value) is True
            assert box.claim(conn, value) is False
        else:
            with pytest.raises((InvalidArgument, InvalidValue)) as err:
                box.claim(conn, value)
            assert err.value.name == "message_id"  # names the argument, and its value as written
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # nothing was sent
        conn.rollback()


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_a_lone_surrogate_is_refused_naming_it(pg_dsn, schema):
    # A str that is not text (bytes decoded with surrogateescape, say): UTF-8 cannot encode it.
    box = Inbox("c", schema=schema, registry=None)
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(InvalidValue) as err:
            box.claim(conn, "id-\udcff")
        assert err.value.name == "message_id" and repr("id-\udcff") in str(err.value)
        conn.execute("SELECT 1")  # the caller's transaction goes on
        conn.rollback()


def test_a_consumer_name_is_checked(schema):
    for bad in ["", "x" * 201, None, 3, "a\x00b", "a\ud800"]:
        with pytest.raises((InvalidArgument, InvalidValue)):
            Inbox(bad, schema=schema)  # type: ignore[arg-type]


def test_repeatable_read_is_refused_and_the_caller_goes_on(pg_dsn, schema):
    box = Inbox("c", schema=schema)
    with psycopg.connect(pg_dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT 1")
        with pytest.raises(IsolationNotSupported):
            box.claim(conn, "m")
        conn.execute("SELECT 1")  # still usable
        conn.rollback()
        conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
        assert box.claim(conn, "m")
        conn.commit()


def test_the_inbox_refusals_have_sqlstates_of_their_own(pg_dsn, schema):
    # Each refusal's SQLSTATE is documented with the inbox's error, and none is another refusal's:
    # an effect whose tracker call is refused (TooManyGroups, RT008) is not an isolation problem.
    box = Inbox("c", schema=schema, registry=None)
    with psycopg.connect(pg_dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        with pytest.raises(IsolationNotSupported) as raised:
            box.claim(conn, "m")
        conn.rollback()
    state = raised.value.__cause__.sqlstate
    assert SQLSTATES[state][1] == (IsolationNotSupported,)

    def refused(c: psycopg.Connection) -> None:
        c.execute("DO $$ BEGIN RAISE EXCEPTION 'too many groups' USING ERRCODE = 'RT008'; END $$")

    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(psycopg.Error) as raised_by_effect:
            box.run_once(conn, "m2", refused)
        assert raised_by_effect.value.sqlstate == "RT008"


@pytest.mark.parametrize("consumer", [["billing"], {"a": 1}, 7, None, ""])
def test_the_module_functions_name_a_bad_consumer_of_any_type(pg_dsn, schema, consumer):
    with psycopg.connect(pg_dsn) as conn:
        for call in (
            lambda: inbox.claim(conn, "m", consumer=consumer, schema=schema),
            lambda: inbox.run_once(conn, "m", lambda c: None, consumer=consumer, schema=schema),
        ):
            with pytest.raises((InvalidArgument, InvalidValue)) as info:
                call()
            assert str(info.value).startswith("consumer")
        with pytest.raises(InvalidIdentifier, match="schema"):
            inbox.claim(conn, "m", consumer="c", schema=["reaper"])
        conn.execute("SELECT 1")  # the caller's transaction goes on
