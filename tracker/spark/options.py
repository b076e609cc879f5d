"""The counts a Spark function is given (tasks, offsets per micro-batch), checked on the driver
before any job runs: a count Spark cannot use either fails from inside the JVM (a raw Py4J error)
or, negative, makes no task at all, so that nothing is applied and nothing is reported."""

from __future__ import annotations

from tracker.errors import InvalidArgument, InvalidValue

# Tasks of one step (apply transactions, Kafka read-and-fold tasks): far more than any cluster runs
# usefully at once, and few enough that Spark's per-task bookkeeping on the driver stays small.
TASKS_MAX = 100_000
# Spark reads maxOffsetsPerTrigger as a Java long.
OFFSETS_MAX = (1 << 63) - 1


def optional_count(name: str, value: object, most: int) -> int | None:
    """`value` if it is None or an int from 1 to `most` (not a bool), else a typed error naming it."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidArgument(name, value, "an int or None")
    if not 1 <= value <= most:
        raise InvalidValue(name, value, f"must be from 1 to {most:,}, or None for the default")
    return value


def optional_tasks(name: str, value: object) -> int | None:
    """A number of tasks, or None (the default)."""
    return optional_count(name, value, TASKS_MAX)
