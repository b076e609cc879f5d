"""The step protocol between the tracker's I/O-free core and its two faces.

Every tracker operation (open, add, enqueue, close, ack, exactly_once, status) is a generator that
does no I/O: it yields steps and receives their results. A driver (tracker/drivers/) runs the steps on
its connection, inside the call's boundary (tracker/drivers/calls.py), so the SQL, the COPY
encoding and every check exist once.

    Round(queries, last=False) -> list of results, one per query, sent in one round trip:
        fetch "none" -> None, "one" -> a row tuple or None, "all" -> a list of row tuples
        last=True: the operation makes no more database calls and raises nothing afterwards, so
        the face may send the end of the call's savepoint (or transaction) in the same trip.
    Write(copy_sql, chunks, insert_sql, rows) -> None: many rows into one table. Binary COPY when
        the connection can (`chunks()` yields the COPY payload); in pipeline mode, where libpq
        has no COPY, `insert_sql` is run once per tuple of `rows()` (pipelined by psycopg).
    Effect() -> what the caller's effect returned (awaited by the asyncio face).

Rows come back as tuples whatever row factory the caller's connection has.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

Params = Union[Sequence[object], Mapping[str, object], None]
Fetch = Literal["none", "one", "all"]
Row = tuple
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Query:
    sql: str
    params: Params = None
    fetch: Fetch = "none"


@dataclass(frozen=True, slots=True)
class Round:
    queries: tuple[Query, ...]
    last: bool = False


@dataclass(frozen=True, slots=True)
class Write:
    copy_sql: str
    chunks: Callable[[], Iterable[bytes]]
    insert_sql: str
    rows: Callable[[], Iterable[Sequence[object]]]
    # the same target for drivers whose COPY API takes names, not SQL (asyncpg)
    schema: str = ""
    table: str = ""
    columns: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Effect:
    pass


Step = Union[Round, Write, Effect]
# An operation: yields steps, receives each step's result, returns the call's result. What it receives
# is database rows (tuples of whatever the query selects), so the send type is Any: each operation
# unpacks the rows of its own query.
Op = Generator[Step, Any, T]


def one(sql: str, params: Params = None, *, last: bool = False) -> Round:
    """A round trip of one query whose single row (or None) is wanted."""
    return Round((Query(sql, params, "one"),), last)
