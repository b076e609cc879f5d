"""The SQL `enqueue` refuses header arrays of more than one dimension with RT007 naming the argument,
as it does its other header problems, and writes nothing: the outbox could not publish such a row as
written (a nested header_values was paired with the item-id and batch-id headers wrongly, a nested
header_keys failed with a raw 2202E)."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NESTED = [
    ("header_keys", "{{a},{b}}", "{\\\\x01,\\\\x02}"),
    ("header_values", "{a,b,c,d}", "{{\\\\x01,\\\\x02},{\\\\x03,\\\\x04}}"),
    ("header_values", "{a,b}", "{{\\\\x01},{\\\\x02}}"),
    ("header_keys", "{{{a}}}", "{{{\\\\x01}}}"),
]


def _enqueue(c: psycopg.Connection, schema: str, keys: str, values: str) -> None:
    b = c.execute(f'SELECT "{schema}".open_batch()').fetchone()[0]
    c.execute("SAVEPOINT before_enqueue")
    try:
        c.execute(
            f'SELECT * FROM "{schema}".enqueue(%s, %s, ARRAY[%s]::bytea[], header_keys => %s::text[], '
            "header_values => %s::bytea[])",
            [b, "t", b"v", keys, values],
        )
    finally:
        c.execute("ROLLBACK TO SAVEPOINT before_enqueue")  # what the failed call left, or wrote


@pytest.mark.parametrize(("argument", "keys", "values"), NESTED)
def test_enqueue_refuses_nested_header_arrays_naming_the_argument(pg_dsn, schema, argument, keys, values):
    with psycopg.connect(pg_dsn) as c:
        with pytest.raises(psycopg.errors.Error) as got:
            _enqueue(c, schema, keys, values)
        assert got.value.sqlstate == "RT007", f"{got.value.sqlstate}: {got.value}"
        assert got.value.diag.message_detail == argument
        assert str(got.value).startswith(f"{argument} must be a one-dimensional array")
        assert c.execute(f'SELECT count(*) FROM "{schema}".outbox').fetchone() == (0,)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(names=st.lists(st.sampled_from(["a", "b", "trace", "é"]), max_size=4, unique=True))
def test_enqueue_writes_flat_headers_after_item_id_and_batch_id(pg_dsn, schema, names):
    values = [n.encode() for n in names]
    with psycopg.connect(pg_dsn) as c:
        b = c.execute(f'SELECT "{schema}".open_batch()').fetchone()[0]
        c.execute(
            f'SELECT * FROM "{schema}".enqueue(%s, %s, ARRAY[%s]::bytea[], header_keys => %s::text[], '
            "header_values => %s::bytea[])",
            [b, "t", b"v", names, values],
        )
        keys, vals = c.execute(
            f'SELECT header_keys, header_values FROM "{schema}".outbox ORDER BY id DESC LIMIT 1'
        ).fetchone()
        c.rollback()
    assert keys == ["item-id", "batch-id", *names]
    assert vals[1] == str(b).encode() and vals[2:] == values
