"""Request and response bodies of the HTTP API (v1). Strict types: "5" is not a count, true is not 1."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator

from tracker import KAFKA_INTERNAL_TOPICS  # the broker keeps them for itself


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateBatch(_Body):
    user_key: StrictStr | None = Field(default=None, max_length=1000, description="returned in the completion event")
    completion_topic: StrictStr | None = Field(
        default=None,
        min_length=1,
        max_length=249,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="topic of this batch's completion event (default: the server's); not '.' or '..', nor one of "
        "Kafka's internal topics (such as __consumer_offsets), which producers may not write",
    )
    parent: StrictInt | None = Field(
        default=None,
        description="open it as a child of this open batch (of the same tenant): the parent finishes after its "
        "children, failed if one of them failed",
    )
    tolerated_failures: StrictInt | None = Field(
        default=None, description="finish early, as failed, once more than this many of its items failed"
    )
    tolerated_failure_ratio: StrictFloat | StrictInt | None = Field(
        default=None,
        description="0 to 1: finish early, as failed, once (closed) more than this fraction of its items failed",
    )

    @field_validator("completion_topic")
    @classmethod
    def _not_internal(cls, topic: str | None) -> str | None:
        # The broker refuses a producer's records to its own topics: the completion event could
        # never be published. (Other names starting with '__' are topics like any other.)
        if topic in KAFKA_INTERNAL_TOPICS:
            raise ValueError(f"{topic!r} is one of Kafka's internal topics, which producers may not write")
        return topic


class AddItems(_Body):
    count: StrictInt = Field(..., ge=0, description="items to track; the server may cap it (http.max_items_per_add)")


class AckIds(_Body):
    ids: list[StrictStr] = Field(
        ..., description="item ids '<batch>:<group>:<index>' and runs '<batch>:<group>:<start>-<end>'"
    )


class FailIds(_Body):
    ids: list[StrictStr] = Field(
        ..., description="item ids '<batch>:<group>:<index>' and runs '<batch>:<group>:<start>-<end>'"
    )
    reason: StrictStr = Field(..., description="why they failed: 1 to 500 characters, stored once per distinct reason")


class Batch(BaseModel):
    batch_id: int
    user_key: str | None
    completion_topic: str | None
    state: str
    created_at: dt.datetime
    parent_id: int | None = None


class Group(BaseModel):
    """Items start..upto-1 of a group: their ids are '<batch_id>:<group_id>:<index>'."""

    group_id: int
    start: int
    upto: int


class Added(BaseModel):
    batch_id: int
    count: int
    groups: list[Group]


class Closed(BaseModel):
    batch_id: int
    complete: bool = Field(..., description="true if the batch is complete (now or already)")


class AckResult(BaseModel):
    acked: int = Field(..., description="items this request acknowledged")
    duplicates: int = Field(..., description="ids already acknowledged (or named twice)")
    completed: list[int] = Field(..., description="batches this request completed")


class FailResult(BaseModel):
    failed: int = Field(..., description="items this request failed (their first outcome)")
    duplicates: int = Field(..., description="ids already acknowledged or failed (or named twice)")
    completed: list[int] = Field(..., description="batches this request finished")


class Failure(BaseModel):
    item_id: str
    reason: str


class Failures(BaseModel):
    batch_id: int
    failures: list[Failure] = Field(..., description="failed items with their reasons, in item order")
    next: str | None = Field(..., description="pass as `after` for the next page; null on the last page")


class Status(BaseModel):
    batch_id: int
    state: str = Field(..., description="open, closed, complete or expired")
    complete: bool
    total: int
    pending: int
    user_key: str | None
    created_at: dt.datetime
    closed_at: dt.datetime | None
    completed_at: dt.datetime | None
    last_activity_at: dt.datetime
    expired_at: dt.datetime | None
    outcome: str | None = Field(
        ..., description="once complete: succeeded, or failed (an item or a child failed, or a threshold)"
    )
    succeeded: int = Field(..., description="its own items that succeeded (pending + succeeded + failed = total)")
    failed: int = Field(..., description="its own items that failed")
    late: int = Field(..., description="outcomes recorded after it finished (counted, changing no outcome)")
    parent_id: int | None
    children_open: int = Field(..., description="children not finished yet")
    children: int = Field(..., description="children opened under it")
    children_failed: int = Field(..., description="children that finished failed or expired")


class ProblemDoc(BaseModel):
    """RFC 9457 problem details (media type application/problem+json)."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    detail: str
    instance: str = Field(..., description="the request's path (empty when the request could not be read as HTTP)")
    field: str | None = Field(None, description="the request field at fault")
    item_id: str | None = Field(None, description="the item id or run at fault, as sent")
    batch_id: int | None = None
