"""The overview page's figures, gathered from where `reaper outbox status` reads them.

- Per outbox table (every harvest unit of it): backlog, oldest unpublished age, rows in flight per
  leader id, dead rows: harvester.admin.status.unit_status, as `reaper outbox status` reads them
  (the backlog counted up to queries.OVERVIEW_EXACT_ROWS rows, then the id span by the primary key;
  the oldest age from the first row by id; rows in flight among the first OVERVIEW_EXACT_ROWS rows
  by id, where leaders mark; dead rows counted in the dead table).
- Per unit, its leader: the leader group's assignment (status.leaders), from Kafka.
- The acker's lag: the ack topic's end offsets minus the acker group's committed offsets (Kafka).
- Publish rate, refused marks, the sweeper's and settler's last runs: the reapers' own metrics
  (console.metrics_urls), the rate from two reads a refresh apart.
- Dead rows: counted up to status.DEAD_EXACT, then "more than" that.
- Open and closed batches: counted up to queries.UNFINISHED_EXACT index entries, then "more than"
  that with the planner's estimate (queries.Unfinished).
Kafka and the metrics are read at most once per console.refresh_interval, whoever asks, and off
the request path once a first value is there; the database figures on every request (each bounded),
one statement per table plus the count of unfinished batches, all sent at once (reads.read_each):
one round trip to the database, however many tables, and a statement that fails (a lock or
statement timeout, a permission, a missing table) shows its error in its own panel only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx
import psycopg
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from prometheus_client.parser import text_string_to_metric_families

from harvester import logs
from harvester.admin import status
from harvester.config import Config, UnitSpec, ack_topics, acker_group, units
from harvester.publishing.publisher import logs_safe
from harvester.services.ack_offsets import resume_offset
from harvester.services.console import queries
from harvester.services.console.reads import read_each

T = TypeVar("T")
Offload = Callable[[Callable[[], Any]], Awaitable[Any]]  # runs a blocking call on some thread


@dataclass
class UnitRow:
    spec: UnitSpec
    leader: dict[str, Any] | None
    published_total: float | None = None
    publish_rate: float | None = None  # records/s over the last refresh


@dataclass
class TableRow:
    table: str
    status: status.UnitStatus | None  # None: on another database than the console's, or `error`
    units: list[UnitRow]
    error: str | None = None  # its statement failed: the rest of the page still shows


@dataclass
class KafkaView:
    leaders: dict[int, dict[str, Any]] = field(default_factory=dict)
    group_state: str | None = None
    acker_lag: int | None = None
    error: str | None = None


@dataclass
class Runtime:
    """What the reapers' /metrics say (summed over the reapers)."""

    published: dict[str, float] = field(default_factory=dict)  # unit name -> records published
    marks_refused: float | None = None
    sweeper_last_run: float | None = None  # unix time, the latest of any reaper
    settler_last_run: float | None = None
    reached: int = 0
    errors: list[str] = field(default_factory=list)
    at: float = 0.0


@dataclass
class Overview:
    tables: list[TableRow]
    kafka: KafkaView
    runtime: Runtime
    rates: dict[str, float]
    unfinished_batches: queries.Unfinished


class Cached(Generic[T]):
    """One value, fetched again at most every `ttl` seconds, off the request path: the first asker
    waits for it; later ones get the value there is while a stale one is fetched again in the
    background (so a slow Kafka never slows a page down)."""

    def __init__(self, fetch: Callable[[], T], ttl: float, offload: Offload | None = None) -> None:
        self._fetch, self._ttl = fetch, ttl
        self._offload: Offload = offload or asyncio.to_thread  # the thread `fetch` runs on
        self._value: tuple[float, T] | None = None
        self._lock = asyncio.Lock()
        self._refresh: asyncio.Task[None] | None = None

    async def _fetch_now(self) -> None:
        async with self._lock:
            self._value = (time.monotonic(), await self._offload(self._fetch))

    async def get(self) -> T:
        if self._value is None:
            async with self._lock:
                if self._value is None:
                    self._value = (time.monotonic(), await self._offload(self._fetch))
            return self._value[1]
        stale = time.monotonic() - self._value[0] >= self._ttl
        if stale and (self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self._fetch_now())
        return self._value[1]


def kafka_view(cfg: Config) -> KafkaView:
    timeout = cfg.console.kafka_timeout
    view = KafkaView()
    try:
        view.leaders, view.group_state = status.leaders(cfg, timeout)
        view.acker_lag = acker_lag(cfg, timeout)
    except Exception as exc:  # KafkaException or a timeout: the database figures still stand
        view.error = f"{type(exc).__name__}: {exc}"
    return view


def acker_lag(cfg: Config, timeout: float) -> int | None:
    """Messages of every ack topic of the configuration (one per outbox schema) past its acker
    group's committed offsets, all partitions; None when no ack topic exists yet."""
    conf = {"bootstrap.servers": cfg.kafka.bootstrap_servers, **cfg.kafka.client, "logger": logs.KafkaLogger("admin")}
    admin = AdminClient(conf)
    try:
        lags = [
            _topic_lag(admin, topic, acker_group(cfg, topic), timeout)
            for topic in sorted(set(ack_topics(cfg).values()))
        ]
        known = [lag for lag in lags if lag is not None]
        return sum(known) if known else None
    finally:
        admin.poll(0)


def _topic_lag(admin: AdminClient, topic: str, group: str, timeout: float) -> int | None:
    meta = admin.list_topics(topic, timeout=timeout).topics.get(topic)
    if meta is None or meta.error is not None:
        return None
    parts = [TopicPartition(topic, p) for p in meta.partitions]
    ends = admin.list_offsets({tp: OffsetSpec.latest() for tp in parts}, request_timeout=timeout)
    starts = admin.list_offsets({tp: OffsetSpec.earliest() for tp in parts}, request_timeout=timeout)
    committed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group, parts)], request_timeout=timeout)
    done = {tp.partition: tp.offset for tp in committed[group].result(timeout=timeout + 2).topic_partitions}
    lag = 0
    for tp, fut in ends.items():
        end = fut.result(timeout=timeout + 2).offset
        earliest = max(0, starts[tp].result(timeout=timeout + 2).offset)
        lag += max(0, end - resume_offset(done.get(tp.partition, -1), earliest, end))
    return lag


def _urls(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def scrape(urls: Iterable[str], prefix: str, timeout: float) -> Runtime:
    rt = Runtime(at=time.monotonic())
    for url in urls:
        try:
            text = httpx.get(url, timeout=timeout).raise_for_status().text
        except httpx.HTTPError as exc:
            rt.errors.append(f"{url}: {type(exc).__name__}")
            continue
        rt.reached += 1
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == f"{prefix}_unit_records_published_total":
                    unit = s.labels.get("unit", "")
                    rt.published[unit] = rt.published.get(unit, 0.0) + s.value
                elif s.name == f"{prefix}_marks_refused_total":
                    rt.marks_refused = (rt.marks_refused or 0.0) + s.value
                elif s.name == f"{prefix}_sweeper_last_run_timestamp_seconds" and s.value > 0:
                    rt.sweeper_last_run = max(rt.sweeper_last_run or 0.0, s.value)
                elif s.name == f"{prefix}_settler_last_run_timestamp_seconds" and s.value > 0:
                    rt.settler_last_run = max(rt.settler_last_run or 0.0, s.value)
    return rt


class Gatherer:
    """The overview of one configuration: Kafka and metrics cached, the database read per call."""

    def __init__(self, cfg: Config, offload: Offload | None = None) -> None:
        self.cfg = cfg
        self.specs = units(cfg)
        ttl = cfg.console.refresh_interval
        self._kafka = Cached(lambda: kafka_view(cfg), ttl, offload)
        urls = _urls(cfg.console.metrics_urls)
        self._runtime = Cached(lambda: self._scrape(urls), ttl, offload)
        self._previous: Runtime | None = None
        self._rates: dict[str, float] = {}

    def _scrape(self, urls: list[str]) -> Runtime:
        rt = scrape(urls, self.cfg.metrics.prefix, self.cfg.console.kafka_timeout)
        prev = self._previous
        if prev is not None and rt.at > prev.at and rt.reached == prev.reached:
            dt_ = rt.at - prev.at
            self._rates = {u: max(0.0, (n - prev.published.get(u, n)) / dt_) for u, n in rt.published.items()}
        self._previous = rt
        return rt

    def database(self, conn: psycopg.Connection) -> tuple[list[TableRow], queries.Unfinished]:
        """Every table's figures and the unfinished batches, sent at once, each statement on its own
        (its own snapshot, its own error): one round trip to the database."""
        db = self.cfg.database
        tables: dict[tuple[str, str, str], TableRow] = {}
        for spec in self.specs:
            where = (spec.dsn, spec.schema, spec.table)
            if where not in tables:
                tables[where] = TableRow(f"{spec.schema}.{spec.table}", None, [])
            tables[where].units.append(UnitRow(spec, None))
        local = [w for w in tables if w[0] == db.dsn]  # another database's table shows no figures
        statements = [
            status.unit_status_statement(schema, table, exact_up_to=queries.OVERVIEW_EXACT_ROWS)
            for _, schema, table in local
        ]
        statements.append(queries.count_unfinished_statement(db.schema, "default"))
        conn.rollback()  # a pool's connection is idle: make sure of it
        rows = read_each(conn, statements)
        for (_, schema, table), row in zip(local, rows, strict=False):
            t = tables[(db.dsn, schema, table)]
            if isinstance(row, psycopg.Error):
                t.error = _error_text(row)
            else:
                t.status = status.unit_status_of(row, schema, table, exact_up_to=queries.OVERVIEW_EXACT_ROWS)
        last = rows[-1]
        if isinstance(last, psycopg.Error):
            unfinished = queries.Unfinished(None, error=_error_text(last))
        else:
            unfinished = queries.unfinished_of((int(last[0]), last[1]))
        return list(tables.values()), unfinished

    async def gather(self, conn_call: Callable[[Callable[[psycopg.Connection], Any]], Any]) -> Overview:
        (tables, unfinished), kafka, runtime = await asyncio.gather(
            conn_call(self.database), self._kafka.get(), self._runtime.get()
        )
        for t in tables:
            for u in t.units:
                u.leader = kafka.leaders.get(u.spec.index)
                u.published_total = runtime.published.get(u.spec.name)
                u.publish_rate = self._rates.get(u.spec.name)
        return Overview(tables, kafka, runtime, dict(self._rates), unfinished)


def _error_text(exc: psycopg.Error) -> str:
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return f"{logs_safe(exc)}: run `reaper migrate`"
    return logs_safe(exc)
