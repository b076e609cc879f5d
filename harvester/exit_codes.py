"""The exit codes of every `reaper` command, in one place (the documentation's exit-code page is generated from here)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What a `reaper` process's exit status means; `meaning` is the documentation's wording."""

    meaning: str

    def __new__(cls, code: int, meaning: str) -> ExitCode:
        member = int.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        return member

    OK = 0, "done; `reaper run` and `reaper serve`: stopped by SIGTERM/SIGINT after in-flight records were settled"
    FAILURE = (
        1,
        (
            "the database or Kafka failed while the command ran (its transaction was rolled back), or a component of "
            "`reaper run` failed to start or stopped while it ran (the log says which and why)"
        ),
    )
    USAGE = (
        2,
        (
            "bad arguments or configuration (the message names the key or value), a leader topic whose partitions "
            "disagree with the units, brokers that name no cluster id, or a harvester.session_timeout outside the "
            "brokers' group session timeout bounds"
        ),
    )
    UNAVAILABLE = (
        3,
        (
            "the database or Kafka is unreachable, or the schema is not migrated (`reaper run` checks at start and "
            "waits up to `database.startup_timeout` for an unreachable database or Kafka, not for a schema that is not "
            "migrated; `outbox status` still prints what the database says)"
        ),
    )
    DRAIN_TIMEOUT = (
        4,
        (
            "`reaper run` stopped by a signal with records still unsettled at `harvester.drain_timeout`, or stopped "
            "at once by a second SIGTERM/SIGINT during the drain (the next leader re-publishes them: duplicates, "
            "never loss)"
        ),
    )
    NOT_FOUND = (
        5,
        (
            "the batch or dead row named does not exist, the message id named is not in the inbox, or no "
            "dead-lettered ack is at the partition:offset `acks requeue --at` names (or the dead-letter topic does "
            "not exist)"
        ),
    )
    REFUSED = 6, "the state refuses the action (expiring a complete batch)"
    PIPE_CLOSED = (
        141,
        (
            "the reader of the output closed it first (`reaper migrate --dry-run | head`): the output was cut short, "
            "and nothing else is said; what the command had committed stays (`reaper migrate`: run it again to finish)"
        ),
    )
    INTERRUPTED = (
        130,
        (
            "interrupted by SIGINT (Ctrl-C) before it finished: what it had committed stays, what it had not was "
            "rolled back (`reaper migrate`: each migration is a transaction of its own, run it again to finish); "
            "`reaper run` and `reaper serve` stop on SIGINT as on SIGTERM instead"
        ),
    )


def markdown_table() -> str:
    rows = ["| exit code | name | meaning |", "|---|---|---|"]
    rows += [f"| {c.value} | `{c.name}` | {c.meaning} |" for c in ExitCode]
    return "\n".join(rows)
