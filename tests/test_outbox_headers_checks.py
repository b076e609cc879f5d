"""The outbox refuses header arrays it could not publish as written (sql/0024_outbox_headers_flat.sql):
more than one dimension, or a NULL header name. An upgrade adds the checks NOT VALID, moves the rows
written before them that break them to the dead table with the reason, and validates them
(sql/0025_outbox_headers_flat_validate.sql); well-formed rows stay where they are."""

from __future__ import annotations

import shutil
import uuid

import psycopg
import pytest
from support.teardown import drop_schema

from tracker import schema as schema_mod

CHECKS = ["outbox_header_keys_flat", "outbox_header_names_not_null", "outbox_header_values_flat"]

# (header_keys, header_values) as SQL literals, and the reason the upgrade gives
UNFIT = [
    ("'{{a},{b}}'", "'{\\\\x01,\\\\x02}'", "header_keys is not a one-dimensional array"),
    ("'{a,b}'", "'{{\\\\x01},{\\\\x02}}'", "header_values is not a one-dimensional array"),
    ("ARRAY['a', NULL]", "'{\\\\x01,\\\\x02}'", "a header name is NULL"),
]
FIT = [("'{}'", "'{}'"), ("'{a,b}'", "'{\\\\x01,NULL}'"), ("'{\"\",a}'", "'{\\\\x01,\\\\x02}'")]


def _insert(c: psycopg.Connection, schema: str, keys: str, values: str) -> int:
    return c.execute(
        f'INSERT INTO "{schema}".outbox (topic, key, value, header_keys, header_values) '
        f"VALUES ('t', 'k', 'v', {keys}, {values}) RETURNING id"
    ).fetchone()[0]


def _checks(c: psycopg.Connection, schema: str) -> list[tuple[str, bool]]:
    return c.execute(
        "SELECT conname::text, convalidated FROM pg_constraint WHERE conrelid = to_regclass(%s) AND conname = ANY(%s) "
        "ORDER BY 1",
        [f'"{schema}".outbox', CHECKS],
    ).fetchall()


@pytest.mark.parametrize(("keys", "values", "reason"), UNFIT)
def test_the_outbox_refuses_header_arrays_it_could_not_publish(pg_dsn, schema, keys, values, reason):
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert _checks(c, schema) == [(name, True) for name in CHECKS]
        with pytest.raises(psycopg.errors.CheckViolation):
            _insert(c, schema, keys, values)
        for fit_keys, fit_values in FIT:
            _insert(c, schema, fit_keys, fit_values)


def test_an_upgrade_moves_the_rows_that_break_the_checks_aside_and_validates_them(pg_dsn, tmp_path):
    before = tmp_path / "sql"
    shutil.copytree(schema_mod._sql_dir(), before, ignore=shutil.ignore_patterns("0024_*", "0025_*"))
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        schema_mod.migrate(pg_dsn, name, before)
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            assert _checks(c, name) == []
            fit = [_insert(c, name, k, v) for k, v in FIT]
            unfit = [_insert(c, name, k, v) for k, v, _ in UNFIT]
        applied = schema_mod.migrate(pg_dsn, name)
        assert applied == ["0024_outbox_headers_flat.sql", "0025_outbox_headers_flat_validate.sql"]
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            assert _checks(c, name) == [(check, True) for check in CHECKS]
            assert [r[0] for r in c.execute(f'SELECT id FROM "{name}".outbox ORDER BY id')] == fit
            dead = c.execute(f'SELECT id, reason FROM "{name}".outbox_dead ORDER BY id').fetchall()
        assert dead == [(i, f"moved aside by reaper migrate: {reason}") for i, (_, _, reason) in zip(unfit, UNFIT)]
    finally:
        drop_schema(pg_dsn, name)
