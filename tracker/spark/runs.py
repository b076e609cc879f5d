"""Fan-out runs (table spark_fanout_run), taken on the driver and committed before a job starts.

A run number names a job's groups (tracker.spark.fanout), so a retried task finds its partition
written. A run key names a run so that the same job submitted again finds it, and writes only the
partitions the earlier submission did not commit:

- in a batch the caller gives (`fan_out(batch=B, run_key=K)`): the run named K in B;
- in a batch the job opens itself (`fan_out(run_key=K)`): the batch and run that a job of key K
  opened. The run that opened its batch is marked (`opened_batch`) and a key names at most one such
  run in the schema (sql/0023_spark_fanout_job.sql), so two submissions at once open one batch.

A run found in a batch that is closed or complete (its job finished) is returned as it is: the job
runs again and writes nothing, every partition finding its groups.

A run records how many partitions its job had (`partitions`), and each partition's row count is
the size of its groups: a job submitted again whose partition count differs is refused
(PartitionsChanged) before it writes, and a partition whose row count differs fails
(tracker.spark.fanout), since a partition index would name other rows than those it wrote.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from tracker.config import schema_of
from tracker.core.validate import check_topic, check_user_key
from tracker.errors import BatchNotOpen, InvalidArgument, InvalidValue, UnknownBatch

FINISHED = ("closed", "complete")  # states of a batch whose named run may be found again
_OPEN_ATTEMPTS = 3  # a lost race to open a key's batch finds the winner's on the next attempt
_MAX_PARTITIONS = 1 << 20  # the 20 bits of a Spark group id that name a partition (tracker.spark.fanout)


class PartitionsChanged(InvalidValue):
    """A run key names a run whose job had another partition count: submitted with this one, its
    partition indexes would name other rows than those already written. `.recorded` is the count
    the run was first taken with."""

    def __init__(self, partitions: int, recorded: int, batch_id: int, run: int, run_key: str) -> None:
        self.recorded, self.batch_id, self.run, self.run_key = recorded, batch_id, run, run_key
        super().__init__(
            "partitions",
            partitions,
            f"run key {run_key!r} names run {run} of batch {batch_id}, taken with {recorded} partitions: "
            f"a submission must split the rows into the same {recorded} partitions, "
            "or give the job a new run key",
        )


def check_partitions(value: object) -> int | None:
    """None, or a partition count from 0 to MAX_PARTITIONS (2**20)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument("partitions", value, "an int or None")
    if not 0 <= value <= _MAX_PARTITIONS:
        raise InvalidValue("partitions", value, f"must be from 0 to {_MAX_PARTITIONS}")
    return value


def check_run_key(value: object) -> str | None:
    """None, or a non-empty str Postgres text holds, of at most 1,000 characters and 2,000 UTF-8
    bytes (it is indexed, as a user key is)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidArgument("run_key", value, "a non-empty str or None")
    if not value:
        raise InvalidValue("run_key", value, "must be a non-empty string")
    return check_user_key(value, "run_key")


def begin_run(
    conn: psycopg.Connection,
    batch_id: int,
    *,
    schema: str | None = None,
    run_key: str | None = None,
    partitions: int | None = None,
) -> int:
    """Take the next run number of an open batch, or the run already named `run_key` (found also
    in a closed or complete batch, where its job ran to the end), committed before the job starts.
    `partitions` (the job's partition count) is recorded with a new run, or with a found run that
    has none yet. Raises UnknownBatch, BatchNotOpen when a new run is needed in a batch that is not
    open or the batch expired, and PartitionsChanged when the found run had another count."""
    s = schema_of(schema)
    run_key = check_run_key(run_key)
    partitions = check_partitions(partitions)
    batch = sql.Identifier(s, "batch")
    runs = sql.Identifier(s, "spark_fanout_run")
    with conn.transaction():
        row = conn.execute(
            sql.SQL("SELECT state FROM {} WHERE id = %s FOR NO KEY UPDATE").format(batch), [batch_id]
        ).fetchone()
        if row is None:
            raise UnknownBatch(batch_id)
        state = row[0]
        found = None
        if run_key is not None and state in ("open", *FINISHED):
            found = conn.execute(
                sql.SQL("SELECT run, partitions FROM {} WHERE batch_id = %s AND run_key = %s").format(runs),
                [batch_id, run_key],
            ).fetchone()
        if found is not None and partitions is not None:
            recorded = found[1]
            if recorded is None:  # taken by job_batch without a count, or before the count was recorded
                conn.execute(
                    sql.SQL("UPDATE {} SET partitions = %s WHERE batch_id = %s AND run = %s").format(runs),
                    [partitions, batch_id, found[0]],
                )
            elif recorded != partitions:
                assert run_key is not None  # found by it
                raise PartitionsChanged(partitions, recorded, batch_id, int(found[0]), run_key)
        if found is not None and state != "open":
            return int(found[0])
        if state != "open":
            raise BatchNotOpen(batch_id, state)
        # A fan-out is activity: the sweeper must not expire the batch before a partition commits.
        conn.execute(
            sql.SQL("UPDATE {} SET last_activity_at = clock_timestamp() WHERE id = %s").format(batch), [batch_id]
        )
        if found is not None:
            return int(found[0])
        inserted = conn.execute(
            sql.SQL(
                "INSERT INTO {runs} (batch_id, run, run_key, partitions) "
                "SELECT %s, coalesce(max(run) + 1, 0), %s, %s FROM {runs} WHERE batch_id = %s RETURNING run"
            ).format(runs=runs),
            [batch_id, run_key, partitions, batch_id],
        ).fetchone()
        assert inserted is not None  # INSERT ... SELECT of an aggregate: always one row
        return int(inserted[0])


class _Raced(Exception):
    """Another submission of the same key opened its batch first (this transaction is undone)."""


def job_batch(
    conn: psycopg.Connection,
    run_key: str,
    *,
    schema: str | None = None,
    user_key: str | None = None,
    completion_topic: str | None = None,
    partitions: int | None = None,
) -> int:
    """The batch of the fan-out job named `run_key`: the one a job of that key opened, or a new
    one (with `user_key` and `completion_topic`) whose run 0 takes the key with `partitions`,
    committed. A key whose batch was opened with another user key or completion topic raises
    InvalidValue: a run key names one job.

    `conn` should not be in a transaction: each attempt is one of its own. Under REPEATABLE READ
    or SERIALIZABLE a lost race is a serialization failure, retried as a new transaction that sees
    the winner's batch; inside the caller's transaction it cannot be, and is raised."""
    from tracker.sync import open_batch

    s = schema_of(schema)
    key = check_run_key(run_key)
    if key is None:
        raise InvalidArgument("run_key", run_key, "a non-empty str")
    user_key = check_user_key(user_key)
    if completion_topic is not None:
        check_topic(completion_topic, "completion_topic")
    partitions = check_partitions(partitions)
    runs = sql.Identifier(s, "spark_fanout_run")
    find = sql.SQL(
        "SELECT r.batch_id, b.user_key, b.completion_topic FROM {runs} r JOIN {batch} b ON b.id = r.batch_id "
        "WHERE r.run_key = %s AND r.opened_batch"
    ).format(runs=runs, batch=sql.Identifier(s, "batch"))
    claim = sql.SQL(
        "INSERT INTO {} (batch_id, run, run_key, opened_batch, partitions) VALUES (%s, 0, %s, true, %s) "
        "ON CONFLICT DO NOTHING RETURNING batch_id"
    ).format(runs)
    own_transactions = conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    for _ in range(_OPEN_ATTEMPTS):
        try:
            with conn.transaction():
                row = conn.execute(find, [key]).fetchone()
                if row is not None:
                    batch_id, had_user_key, had_topic = row
                    if (had_user_key, had_topic) != (user_key, completion_topic):
                        raise InvalidValue(
                            "run_key",
                            key,
                            f"names the fan-out job of batch {batch_id}, opened with user_key {had_user_key!r} "
                            f"and completion_topic {had_topic!r}: another job needs a run key of its own",
                        )
                    return int(batch_id)
                batch = open_batch(conn, user_key=user_key, completion_topic=completion_topic, schema=s)
                if conn.execute(claim, [batch.id, key, partitions]).fetchone() is None:
                    raise _Raced  # undoes this transaction's batch; the next attempt finds the winner's
                return batch.id
        except _Raced:
            continue
        except psycopg.errors.SerializationFailure:
            # The winner's row is not in this transaction's snapshot; a new transaction sees it.
            if not own_transactions:
                raise
            continue
    raise RuntimeError(f"run_key {key!r}: its batch was opened and gone {_OPEN_ATTEMPTS} times in a row")
