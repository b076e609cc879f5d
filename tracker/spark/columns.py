"""The columns a Spark function reads: there, and of a type it reads, checked on the driver from the
DataFrame's schema before any job runs or anything is written. A typed error names the column as
the caller gave it (a wrong type found inside a task would surface as a Python or Java exception
from the executor, after other tasks may have written)."""

from __future__ import annotations

from typing import Any

from tracker.errors import InvalidArgument, InvalidValue


def check_column(df: Any, what: str, name: object, kinds: tuple[str, ...]) -> str:
    """`name` (the argument `what`) is a column of `df` whose type is one of `kinds` (Spark's type
    names: 'string', 'binary', ...)."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(what, name, "a column name (a non-empty str)")
    if name not in df.columns:
        raise InvalidValue(what, name, f"is not a column of the DataFrame (columns: {df.columns})")
    kind = df.schema[name].dataType
    # Spark may keep a string column's declared varchar(n) or char(n) (spark.sql.preserveCharVarcharTypeInfo)
    accepted = (*kinds, "varchar", "char") if "string" in kinds else kinds
    if kind.typeName() not in accepted:
        raise InvalidValue(what, name, f"is a {kind.simpleString()} column: a {' or '.join(kinds)} column is needed")
    return name
