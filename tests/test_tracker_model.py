"""Random interleavings of the tracker API against a plain Python model (hypothesis state machine).

After every step the model and the database agree on every batch's state, total and pending and
on the completion events written, and invariant 1 holds (checked with SQL).
"""

from __future__ import annotations

import copy

import hypothesis.strategies as st
import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from test_tracker_support import invariant_violations

import tracker
from tracker import outbox
from tracker.core.acks import CLAIMS_PER_CALL_MAX
from tracker.expiry import sweep
from tracker.ids import GROUP_BITS_MAX


class ModelBatch:
    def __init__(self, batch_id: int) -> None:
        self.id = batch_id
        self.state = "open"
        self.sizes: list[int] = []  # group sizes, in group-id order
        self.acked: set[tuple[int, int]] = set()
        self.claimed: set[tuple[int, int]] = set()  # acked in the open transaction, not settled yet
        self.events = 0
        self.user_key: str | None = None

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def pending(self) -> int:
        return self.total - len(self.acked)

    def add(self, n: int) -> None:
        if self.sizes and self.sizes[-1] < GROUP_BITS_MAX:
            k = min(n, GROUP_BITS_MAX - self.sizes[-1])
            self.sizes[-1] += k
            n -= k
        while n:
            k = min(n, GROUP_BITS_MAX)
            self.sizes.append(k)
            n -= k

    def items(self) -> list[tuple[int, int]]:
        return [(g, i) for g, size in enumerate(self.sizes) for i in range(size)]

    def settle(self) -> None:
        self.acked |= self.claimed
        self.claimed = set()

    def complete_if_done(self) -> bool:
        if self.state == "closed" and self.pending == 0:
            self.state = "complete"
            self.events += 1
            return True
        return False


class TrackerMachine(RuleBasedStateMachine):
    def __init__(self, conn: psycopg.Connection, schema: str) -> None:
        super().__init__()
        self.conn, self.schema = conn, schema
        self.batches: dict[int, ModelBatch] = {}
        self.committed: dict[int, ModelBatch] = {}

    # ------------------------------------------------------------------ helpers

    def pick(self, data, *states: str) -> ModelBatch | None:
        choices = sorted(b.id for b in self.batches.values() if not states or b.state in states)
        if not choices:
            return None
        return self.batches[data.draw(st.sampled_from(choices), label="batch")]

    def ids(self, b: ModelBatch, pairs) -> list[str]:
        return [f"{b.id}:{g}:{i}" for g, i in pairs]

    # ------------------------------------------------------------------ rules

    @rule(user_key=st.none() | st.text(max_size=5))
    def open_batch(self, user_key):
        if user_key is not None and "\x00" in user_key:
            with pytest.raises(ValueError, match="NUL"):
                tracker.open_batch(self.conn, user_key=user_key, schema=self.schema)
            return
        b = tracker.open_batch(self.conn, user_key=user_key, schema=self.schema)
        self.batches[b.id] = ModelBatch(b.id)
        self.batches[b.id].user_key = user_key

    @rule(data=st.data(), n=st.integers(0, 40))
    def enqueue(self, data, n):
        b = self.pick(data)
        if b is None:
            return
        items = [f"v{i}" for i in range(n)]
        if b.state != "open":
            with pytest.raises(tracker.BatchNotOpen):
                outbox.enqueue(self.conn, b.id, items, topic="work", schema=self.schema)
            return
        handles = outbox.enqueue(self.conn, b.id, items, topic="work", schema=self.schema)
        before = len(b.items())
        b.add(n)
        expanded = [i for h in handles for i in h.item_ids]
        assert expanded == self.ids(b, b.items()[before:])

    @rule(data=st.data(), n=st.sampled_from([0, 1, 3, 100, GROUP_BITS_MAX - 1, GROUP_BITS_MAX + 2]))
    def add(self, data, n):
        b = self.pick(data)
        if b is None:
            return
        if b.state != "open":
            with pytest.raises(tracker.BatchNotOpen, match=b.state):
                tracker.add_items(self.conn, b.id, n, schema=self.schema)
            return
        handles = tracker.add_items(self.conn, b.id, n, schema=self.schema)
        assert sum(h.count for h in handles) == n
        b.add(n)

    @rule(data=st.data())
    def ack(self, data):
        b = self.pick(data, "open", "closed", "complete")
        if b is None or not b.total:
            return
        items = b.items()
        chosen = data.draw(st.lists(st.sampled_from(items), max_size=30), label="acks")
        if data.draw(st.booleans(), label="run"):  # sometimes a whole group as one run
            g = data.draw(st.integers(0, len(b.sizes) - 1), label="group")
            ids = self.ids(b, chosen) + [f"{b.id}:{g}:0-{b.sizes[g] - 1}"]
            chosen = chosen + [(g, i) for i in range(b.sizes[g])]
        else:
            ids = self.ids(b, chosen)
        r = tracker.ack(self.conn, ids, schema=self.schema)
        if len(chosen) > CLAIMS_PER_CALL_MAX:  # a bulk ack: masked updates, applied at once
            new = set(chosen) - b.acked
            assert (r.acked, r.duplicates) == (len(new), len(chosen) - len(new))
            b.acked |= new
            b.claimed -= new
            assert r.completed == ([b.id] if b.complete_if_done() else [])
            return
        new = set(chosen) - b.acked - b.claimed
        assert (r.acked, r.duplicates) == (len(new), len(chosen) - len(new))
        b.claimed |= new  # acks are claims, settled at commit (or by a close)
        assert r.completed == []

    @rule(data=st.data())
    def duplicate_ack(self, data):
        b = self.pick(data)
        if b is None or not (b.acked or b.claimed):
            return
        again = data.draw(
            st.lists(st.sampled_from(sorted(b.acked | b.claimed)), min_size=1, max_size=10), label="again"
        )
        if b.state == "expired":
            with pytest.raises(tracker.BatchExpired):
                tracker.ack(self.conn, self.ids(b, again), schema=self.schema)
            return
        r = tracker.ack(self.conn, self.ids(b, again), schema=self.schema)
        assert (r.acked, r.duplicates, r.completed) == (0, len(again), [])

    @rule(data=st.data(), kind=st.sampled_from(["range", "group", "batch"]))
    def bad_ack(self, data, kind):
        b = self.pick(data, "open", "closed", "complete")
        if b is None or not b.total:
            return
        good = self.ids(b, b.items()[:1])
        bad, error = {
            "range": (f"{b.id}:{len(b.sizes) - 1}:{b.sizes[-1]}", tracker.IndexOutOfRange),
            "group": (f"{b.id}:{len(b.sizes)}:0", tracker.UnknownGroup),
            "batch": (f"{max(self.batches) + 1000}:0:0", tracker.UnknownBatch),
        }[kind]
        with pytest.raises(error):
            tracker.ack(self.conn, good + [bad], schema=self.schema)

    @rule(data=st.data())
    def close(self, data):
        b = self.pick(data)
        if b is None:
            return
        if b.state == "expired":
            with pytest.raises(tracker.BatchExpired):
                tracker.close_batch(self.conn, b.id, schema=self.schema)
            return
        done = tracker.close_batch(self.conn, b.id, schema=self.schema)
        b.settle()  # a close first settles the batch's claims
        if b.state == "open":
            b.state = "closed"
        b.complete_if_done()
        assert done == (b.state == "complete")

    @rule(data=st.data())
    def expire(self, data):
        b = self.pick(data, "open", "closed")
        if b is None:
            return
        self.conn.execute(
            f"UPDATE \"{self.schema}\".batch SET last_activity_at = now() - interval '1 day' WHERE id = %s", [b.id]
        )
        assert sweep(self.conn, schema=self.schema, idle_expiry=3600, retention=10 * 86400).expired == 1
        b.state = "expired"
        b.events += 1  # the expiry event, on the batch's completion topic (tracker.expiry)

    @rule(data=st.data())
    def status(self, data):
        b = self.pick(data)
        if b is None:
            return
        s = tracker.status(self.conn, b.id, schema=self.schema)
        assert (s.state, s.total, s.pending, s.user_key) == (b.state, b.total, b.pending, b.user_key)
        if b.state != "expired":
            assert (s.closed_at is not None) == (b.state in ("closed", "complete"))
        assert (s.completed_at is not None) == (b.state == "complete")

    @precondition(lambda self: self.batches)
    @rule()
    def commit(self):
        self.conn.commit()
        for b in self.batches.values():  # the commit settles this transaction's claims
            b.settle()
            b.complete_if_done()
        self.committed = copy.deepcopy(self.batches)

    @precondition(lambda self: self.batches)
    @rule()
    def rollback(self):
        self.conn.rollback()
        self.batches = copy.deepcopy(self.committed)

    def teardown(self):
        self.conn.rollback()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def database_agrees_with_model(self):
        assert invariant_violations(self.conn, self.schema) == []
        if not self.batches:
            return
        s = f'"{self.schema}"'
        rows = self.conn.execute(
            f"SELECT b.id, b.state, b.total, b.pending, "
            f"(SELECT count(*) FROM {s}.outbox o WHERE o.topic = 'batch-completions' AND o.key = convert_to(b.id::text, 'UTF8')) "
            f"FROM {s}.batch b WHERE b.id = ANY(%s) ORDER BY b.id",
            [sorted(self.batches)],
        ).fetchall()
        assert rows == [(b.id, b.state, b.total, b.pending, b.events) for _, b in sorted(self.batches.items())]


def test_tracker_agrees_with_model(pg_dsn, schema):
    with psycopg.connect(pg_dsn) as conn:
        run_state_machine_as_test(
            lambda: TrackerMachine(conn, schema),
            settings=settings(
                max_examples=60,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            ),
        )
        conn.rollback()
