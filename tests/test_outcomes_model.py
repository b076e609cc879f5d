"""Outcomes under random interleavings (hypothesis state machine on the real database) against a
plain Python model: acks, failures, duplicates, retries (an ack after a failure), closes, children
opened under open parents, children finishing (folded into their parents at the parents' next
close, ack, failure or settle), settles, thresholds, expiry.

After every step: pending + succeeded + failed = total per group and per batch, the database's
counts, state and outcome equal the model's, and each batch has exactly the events the model
wrote (at most one: one completion or one expiry), whose counts are the model's at that moment.
"""

from __future__ import annotations

import json
from decimal import Decimal

import hypothesis.strategies as st
import psycopg
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from test_tracker_support import invariant_violations

import tracker
from tracker.expiry import expire_batch

REASONS = ["timeout", "bad input", "x" * 500]


class Model:
    def __init__(self, batch_id: int, parent: Model | None, tf: int | None, ratio: float | None) -> None:
        self.id, self.parent, self.tf, self.ratio = batch_id, parent, tf, ratio
        self.depth = 0 if parent is None else parent.depth + 1
        self.state = "open"
        self.sizes: list[int] = []
        self.items: dict[tuple[int, int], str | None] = {}  # None pending, "ok", or the failure reason
        self.outcome: str | None = None
        self.late = 0
        self.children = self.children_open = self.children_failed = 0
        self.rollup_total = self.rollup_failed = 0
        self.unfolded: list[tuple[dict, bool]] = []  # finished children not folded in yet (child_finished)
        self.events: list[dict] = []  # what its one event must say

    @property
    def total(self) -> int:
        return len(self.items)

    @property
    def pending(self) -> int:
        return sum(1 for v in self.items.values() if v is None)

    @property
    def failed(self) -> int:
        return sum(1 for v in self.items.values() if v not in (None, "ok"))

    @property
    def succeeded(self) -> int:
        return self.total - self.pending - self.failed

    def rollup(self) -> dict:
        failed = self.pending + self.failed + self.rollup_failed
        return {
            "total": self.total + self.rollup_total,
            "succeeded": self.total + self.rollup_total - failed,
            "failed": failed,
        }

    def add(self, n: int) -> None:
        while n:
            if self.sizes and self.sizes[-1] < 8192:
                g = len(self.sizes) - 1
            else:
                self.sizes.append(0)
                g = len(self.sizes) - 1
            k = min(n, 8192 - self.sizes[g])
            for i in range(self.sizes[g], self.sizes[g] + k):
                self.items[(g, i)] = None
            self.sizes[g] += k
            n -= k

    def try_finish(self) -> None:
        if self.state not in ("open", "closed"):
            return
        bad = self.failed + self.rollup_failed
        closed_idle = self.state == "closed" and self.children_open == 0
        if not (
            (closed_idle and self.pending == 0)
            or (self.tf is not None and bad > self.tf)
            or (
                closed_idle
                and self.ratio is not None
                and bad > Decimal(repr(self.ratio)) * (self.total + self.rollup_total)
            )
        ):
            return
        self.state = "complete"
        failed = self.pending or self.failed or self.rollup_failed or self.children_failed or self.children_open
        self.outcome = "failed" if failed else "succeeded"
        self.events.append({"event": "batch.completed", "outcome": self.outcome, **self.counts()})
        self.fold()

    def counts(self) -> dict:
        return {"succeeded": self.succeeded, "failed": self.failed, "pending": self.pending, "rollup": self.rollup()}

    def fold(self) -> None:
        """Finished or expired: leaves its roll-up, as its event says, for its parent to fold in
        under the parent's own row lock (it never locks its parent)."""
        if self.parent is not None:
            self.parent.unfolded.append((self.rollup(), self.outcome != "succeeded"))

    def absorb(self) -> None:
        """Under its own row lock (its close, acks, failures, a settle): fold in finished children."""
        for r, failed in self.unfolded:
            self.children_open -= 1
            self.rollup_total += r["total"]
            self.rollup_failed += r["failed"]
            self.children_failed += 1 if failed else 0
        self.unfolded = []

    def record(self, keys: list[tuple[int, int]], outcome: str) -> int:
        flipped = 0
        for k in keys:
            if self.items[k] is None:
                self.items[k] = outcome
                flipped += 1
        if flipped and self.state == "complete":
            self.late += flipped
        self.absorb()
        self.try_finish()
        return flipped


class OutcomesMachine(RuleBasedStateMachine):
    def __init__(self, conn: psycopg.Connection, schema: str) -> None:
        super().__init__()
        self.conn, self.schema = conn, schema
        self.batches: dict[int, Model] = {}
        conn.execute(f'DELETE FROM "{schema}".outbox')
        conn.commit()

    def pick(self, data, *states: str, label: str = "batch", items: bool = False) -> Model | None:
        ids = sorted(b.id for b in self.batches.values() if b.state in states and (b.items or not items))
        return self.batches[data.draw(st.sampled_from(ids), label=label)] if ids else None

    def some_items(self, data, b: Model) -> list[tuple[int, int]]:
        keys = sorted(b.items)
        return data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=6), label="items") if keys else []

    @rule(
        data=st.data(),
        child=st.booleans(),
        tf=st.none() | st.integers(0, 3),
        ratio=st.none() | st.sampled_from([0.0, 0.25, 0.5, 1.0]),
    )
    def open_batch(self, data, child, tf, ratio):
        parent = self.pick(data, "open", label="parent") if child else None
        if parent is not None and parent.depth >= 7:
            return
        b = tracker.open_batch(
            self.conn,
            parent=parent and parent.id,
            tolerated_failures=tf,
            tolerated_failure_ratio=ratio,
            schema=self.schema,
        )
        self.conn.commit()
        self.batches[b.id] = Model(b.id, parent, tf, ratio)
        if parent is not None:
            parent.children += 1
            parent.children_open += 1

    @rule(data=st.data(), n=st.integers(1, 12))
    def add(self, data, n):
        b = self.pick(data, "open")
        if b is None:
            return
        tracker.add_items(self.conn, b.id, n, schema=self.schema)
        self.conn.commit()
        b.add(n)

    @rule(data=st.data(), claims=st.booleans())
    def ack(self, data, claims):
        """Acks, duplicates of earlier acks, and retries of failed items (duplicates too)."""
        b = self.pick(data, "open", "closed", "complete", items=True)
        if b is None:
            return
        keys = self.some_items(data, b)
        tracker.ack(self.conn, [f"{b.id}:{g}:{i}" for g, i in keys], claims=claims, schema=self.schema)
        self.conn.commit()
        b.record(keys, "ok")

    @rule(data=st.data(), reason=st.sampled_from(REASONS))
    def fail(self, data, reason):
        b = self.pick(data, "open", "closed", "complete", items=True)
        if b is None:
            return
        keys = self.some_items(data, b)
        r = tracker.fail(self.conn, [f"{b.id}:{g}:{i}" for g, i in keys], reason, schema=self.schema)
        self.conn.commit()
        before = [e for m in self.batches.values() for e in m.events]
        assert r.failed == b.record(keys, reason)
        assert (b.id in r.completed) == (len([e for m in self.batches.values() for e in m.events]) > len(before))

    @rule(data=st.data())
    def close(self, data):
        b = self.pick(data, "open", "closed", "complete")
        if b is None:
            return
        complete = tracker.close_batch(self.conn, b.id, schema=self.schema)
        self.conn.commit()
        b.absorb()  # the close settles the batch first (folding its finished children in)
        b.try_finish()
        if b.state == "open":
            b.state = "closed"
            b.try_finish()
        assert complete == (b.state == "complete")

    @rule(data=st.data())
    def expire(self, data):
        b = self.pick(data, "open", "closed")
        if b is None:
            return
        assert expire_batch(self.conn, b.id, schema=self.schema, registry=None) is not None
        self.conn.commit()
        b.absorb()  # the operator's expiry folds in the children that finished before it
        b.state = "expired"
        b.events.append({"event": "expired", "outcome": "expired", **b.counts()})
        b.fold()

    @rule()
    def settle(self):
        """The reaper's settle loop: batches with finished children not folded in, in id order,
        pass after pass while a pass finishes something (its parent then has a row to fold in)."""
        r = tracker.settle(self.conn, schema=self.schema, registry=None)
        self.conn.commit()
        completed = []
        for _ in range(8):
            ids = sorted(b.id for b in self.batches.values() if b.unfolded)
            if not ids:
                break
            finished = False
            for i in ids:
                b = self.batches[i]
                was = b.state
                b.absorb()
                b.try_finish()
                if b.state != was:
                    completed.append(i)
                    finished = True
            if not finished:
                break
        assert r.completed == completed

    def teardown(self):
        self.conn.rollback()

    @invariant()
    def database_agrees_with_model(self):
        assert invariant_violations(self.conn, self.schema) == []
        if not self.batches:
            return
        s = f'"{self.schema}"'
        rows = self.conn.execute(
            f"SELECT id, state, total, pending, failed, late, outcome, children, children_open, children_failed, "
            f"rollup_total, rollup_failed FROM {s}.batch WHERE id = ANY(%s) ORDER BY id",
            [sorted(self.batches)],
        ).fetchall()
        want = [
            (
                b.id, b.state, b.total, b.pending, b.failed, b.late, b.outcome, b.children, b.children_open,
                b.children_failed, b.rollup_total, b.rollup_failed,
            )
            for _, b in sorted(self.batches.items())
        ]  # fmt: skip
        assert rows == want
        # per group: pending + succeeded + failed = size, failed as the model says
        groups = self.conn.execute(
            f"SELECT batch_id, id, size, pending, failed FROM {s}.batch_group WHERE batch_id = ANY(%s)",
            [sorted(self.batches)],
        ).fetchall()
        for batch_id, g, size, pending, failed in groups:
            items = [v for (gg, _), v in self.batches[batch_id].items.items() if gg == g]
            assert (size, pending, failed) == (
                len(items),
                items.count(None),
                sum(1 for v in items if v not in (None, "ok")),
            )
        got: dict[int, list[dict]] = {}
        for key, value in self.conn.execute(f"SELECT key, value FROM {s}.outbox ORDER BY id").fetchall():
            got.setdefault(int(bytes(key)), []).append(json.loads(bytes(value)))
        for b in self.batches.values():
            events = got.get(b.id, [])
            assert len(events) == len(b.events) <= 1, (b.id, events)
            for event, expected in zip(events, b.events):
                assert {k: event[k] for k in expected} == expected

    def check_failures(self) -> None:
        for b in self.batches.values():
            want = sorted(((g, i), v) for (g, i), v in b.items.items() if v not in (None, "ok"))
            seen, after = [], None
            while True:
                page = tracker.failures(self.conn, b.id, after=after, limit=3, schema=self.schema)
                seen.extend(page.items)
                if page.next is None:
                    break
                after = page.next
            assert seen == [(f"{b.id}:{g}:{i}", v) for (g, i), v in want]


class CheckedMachine(OutcomesMachine):
    @rule()
    def read_failures(self):
        self.check_failures()
        self.conn.rollback()


def test_outcomes_agree_with_the_model(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        run_state_machine_as_test(
            lambda: CheckedMachine(conn, schema),
            settings=settings(
                max_examples=100,
                stateful_step_count=50,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
        conn.rollback()
