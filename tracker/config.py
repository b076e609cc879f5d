"""A tracker's configuration: which schema, outbox table and default completion topic it uses.

Held by each `Tracker` / `AsyncTracker`; nothing on any path reads process-wide defaults, so two
trackers for two schemas in one process never interfere.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracker.core.validate import check_topic
from tracker.errors import InvalidValue
from tracker.schema import check_identifier

DEFAULT_SCHEMA = "reaper"
DEFAULT_OUTBOX_TABLE = "outbox"
DEFAULT_COMPLETION_TOPIC = "batch-completions"


@dataclass(frozen=True, slots=True)
class TrackerConfig:
    schema: str = DEFAULT_SCHEMA
    outbox_table: str = DEFAULT_OUTBOX_TABLE
    completion_topic: str = DEFAULT_COMPLETION_TOPIC

    def __post_init__(self) -> None:
        check_identifier(self.schema, "schema")
        check_identifier(self.outbox_table, "outbox table")
        if not isinstance(self.completion_topic, str) or not self.completion_topic:
            raise InvalidValue("completion_topic", self.completion_topic, "must be a non-empty string")
        check_topic(self.completion_topic, "completion_topic")


def schema_of(schema: str | None) -> str:
    """`schema` validated, or the default schema when None."""
    return DEFAULT_SCHEMA if schema is None else check_identifier(schema, "schema")
