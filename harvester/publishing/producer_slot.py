"""The producer slot: which producer is current, retiring it, and the one thread serving callbacks.

Contract:
- `current` is the producer records go to. `send()` hands a record to a given producer under the
  swap lock and refuses (returns False) once that producer was retired: a retired producer never
  gets another record.
- `retire()` swaps in a fresh producer and purges everything the old one holds, queued AND in
  flight, so nothing of an old leadership can be sent or retried later (with message.timeout.ms=0 an
  in-flight record would otherwise be retried for ever, and could land after the next leader's
  records of its key). The purged records' reports reset their rows under the old leader id. A
  producer that never got a record (nor began, nor initialised, a transaction) has nothing to drop:
  it is kept. (In fenced mode a leader initialises its producers as soon as it leads, so every
  leadership that ends retires them: they hold that leadership's producer epoch.)
- Only one thread at a time serves a producer's callbacks (serving one producer from two threads
  at once, flush here and poll there, was seen to deadlock): the poll thread, holding `serving`
  around every poll, or a thread that took `hold_polls()` (a transaction abort). The poll thread
  also serves retired producers until their last report is out.
- A fatal producer error sets `broken`; `replace_if_broken()` then retires the producer.
- With `producers` > 1 (transactional publishing) the slot holds a fixed *set* of producers, the
  i-th (i > 0) with transactional id `<id>#<i>`; `current` is one of them, and `rotate()` makes
  the next one current between two transactions. Everything above applies to the set: `retire()`
  replaces and purges all of them, and the poll thread serves all of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial

from confluent_kafka import KafkaError, KafkaException

from harvester import logs
from harvester.publishing.ports import ProducerFactory, ProducerLike


class ProducerSlot:
    def __init__(
        self,
        conf: dict,
        factory: ProducerFactory,
        *,
        on_fatal: Callable[[str], None] = lambda why: None,
        after_poll: Callable[[], None] = lambda: None,
        on_retire: Callable[[], None] = lambda: None,
        producers: int = 1,
    ) -> None:
        if producers < 1:
            raise ValueError(f"producers must be >= 1, got {producers!r}")
        if producers > 1 and "transactional.id" not in conf:
            raise ValueError("several producers in one slot are for transactional publishing only")
        self._conf, self._factory = conf, factory
        self._count = producers
        # The poll thread waits on `current` only; after a rotate() it may still be waiting on the
        # previous one, so while transactions run (busy()) it waits briefly and re-reads `current`.
        # Idle or standing by, it waits 20 ms as with one producer.
        self._busy_until = 0.0
        self._on_fatal, self._after_poll, self._on_retire = on_fatal, after_poll, on_retire
        self._log = logs.get("reaper.publish")
        self._swap = threading.Lock()  # held across each send(): see the contract
        self._retire_lock = threading.Lock()  # NELI's thread and the marking thread may both retire
        self.serving = threading.Lock()  # held by whichever thread serves the producer's callbacks
        self._polls_held = threading.Event()
        self._retiring: list[ProducerLike] = []
        self._retiring_lock = threading.Lock()
        self._stop = threading.Event()
        self.broken = False
        self.retired = 0
        self.used = False  # a producer of the set got a record, or began or initialised a transaction
        self.producers: tuple[ProducerLike, ...] = self._new_set()
        self.current: ProducerLike = self.producers[0]
        self._thread = logs.unit_thread(self._poll_loop, "reaper-poll")

    def _new_set(self) -> tuple[ProducerLike, ...]:
        made = []
        for i in range(self._count):
            conf = dict(self._conf)
            if i:  # '#' is refused in configured ids, so no other unit's id can be one of these
                conf["transactional.id"] = self.transactional_id(i)
            cell: list[ProducerLike] = []  # the producer, once made: its callbacks know whose they are
            conf["error_cb"] = partial(self._on_error, cell)
            conf["logger"] = _RetiredQuiet(conf.get("logger") or logs.KafkaLogger("producer"), cell, self)
            cell.append(self._factory(conf))
            made.append(cell[0])
        return tuple(made)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ producing

    def send(self, producer: ProducerLike, args: tuple) -> bool:
        """produce(*args) on `producer` unless it was retired meanwhile (then False, nothing sent)."""
        with self._swap:
            if self.current is not producer:
                return False
            self.used = True
            producer.produce(*args)
        return True

    def transactional_id(self, index: int) -> str:
        base = str(self._conf.get("transactional.id", ""))
        return f"{base}#{index}" if index else base

    def busy(self, seconds: float = 0.2) -> None:
        """Transactions are running: poll with short waits for a while (see __init__)."""
        if self._count > 1:
            self._busy_until = time.monotonic() + seconds

    def rotate(self, after: ProducerLike) -> None:
        """Make the next producer of the set current, if `after` still is (not retired meanwhile)."""
        with self._swap:
            if self.current is after and self._count > 1:
                self.current = self.producers[(self.producers.index(after) + 1) % self._count]
                self.busy()

    def retire(self, why: str, *, routine: bool = False) -> bool:
        """Swap the producers for new ones and drop all the old ones hold (see the contract).
        Returns False, and keeps them, when none was ever used. `routine`: the caller already
        logged its cause (a change of leadership), so the retirement is an info line, not news."""
        with self._retire_lock:
            if not self.used and not self.broken:
                return False
            new = self._new_set()
            with self._swap:
                old, self.producers, self.current = self.producers, new, new[0]
                self.broken = self.used = False
            self._on_retire()
            for producer in old:
                try:
                    producer.purge(in_queue=True, in_flight=True)
                except Exception as exc:  # a broken producer may refuse; it gets no new record either way
                    self._log.warning("purging the retired producer failed", error=str(exc))
            with self._retiring_lock:
                self._retiring.extend(old)
            self.retired += 1
        (self._log.info if routine else self._log.warning)("producer retired and replaced", reason=why)
        return True

    def replace_if_broken(self) -> bool:
        if not self.broken:
            return False
        return self.retire("fatal producer error")

    @property
    def retiring(self) -> list[ProducerLike]:
        with self._retiring_lock:
            return list(self._retiring)

    @contextlib.contextmanager
    def hold_polls(self) -> Iterator[None]:
        """Serve the current producer's callbacks from this thread for a while (the poll thread
        stands aside; else, re-taking `serving` at once after each poll, it could starve us)."""
        self._polls_held.set()
        try:
            with self.serving:
                yield
        finally:
            self._polls_held.clear()

    # ------------------------------------------------------------------ serving callbacks

    def is_retired(self, producer: ProducerLike | None) -> bool:
        return producer is not None and not any(producer is p for p in self.producers)

    def _on_error(self, cell: list[ProducerLike], err: KafkaError) -> None:
        if self.is_retired(cell[0] if cell else None):
            # Its records were purged on purpose (queued and in flight): librdkafka's gap-less
            # guarantee reports that as fatal, about a producer that gets nothing more anyway.
            self._log.info("retired producer reported an error after its retirement", error=str(err))
            return
        if err.fatal():
            self._fatal(err)
        else:
            self._log.info("producer client error", error=str(err))

    def _fatal(self, err: KafkaError | str) -> None:
        """The current producers are broken for good: replaced at the marker's next turn."""
        if self.broken:
            return  # told already (error_cb, then poll(), may both say it)
        self.broken = True
        self._log.error("fatal producer error", error=str(err))
        self._on_fatal("fatal producer error")

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            if self._polls_held.is_set():
                time.sleep(0.001)
                continue
            try:
                with self.serving:
                    current = self.current
                    self._poll(current, 0.002 if time.monotonic() < self._busy_until else 0.02)
                    for other in self.producers:
                        if other is not current:
                            self._poll(other, 0)
                    for old in self.retiring:
                        self._poll(old, 0)
                        if len(old) == 0:
                            with self._retiring_lock:
                                self._retiring.remove(old)
            except Exception as exc:
                self._log.error("producer poll failed", error=str(exc))
                time.sleep(0.1)
            self._after_poll()

    def _poll(self, producer: ProducerLike, timeout: float) -> None:
        try:
            producer.poll(timeout)
        except KafkaException as exc:
            if self.is_retired(producer):
                # Records purged in flight: the gap-less guarantee's fatal error, raised by the poll
                # of a producer retired meanwhile (perhaps while this very poll waited). Expected.
                self._log.info("retired producer reported an error after its retirement", error=str(exc))
                return
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.fatal():
                # confluent-kafka raises a fatal error from poll() where error_cb may not be told:
                # the producer refuses every record from now on, so it is replaced all the same.
                self._fatal(err)
                return
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Drop whatever is still queued, serve the last reports, stop the poll thread."""
        for producer in self.producers:
            try:
                producer.purge(in_queue=True, in_flight=True)
            except Exception:
                pass
        deadline = time.monotonic() + min(timeout, 2.0)
        while (any(len(p) for p in self.producers) or self.retiring) and time.monotonic() < deadline:
            time.sleep(0.01)  # the poll thread serves the purged reports
        self._stop.set()
        self._thread.join(timeout)


class _RetiredQuiet:
    """A producer's librdkafka log: once the producer is retired, its warning and error lines (the
    gap-less guarantee's FATAL about records purged in flight) drop to below warning: the purge is
    the retirement's own doing, the producer gets nothing more, and its error callback says so
    once in an info line."""

    def __init__(self, inner, cell: list[ProducerLike], slot: ProducerSlot) -> None:
        self._inner, self._cell, self._slot = inner, cell, slot

    def log(self, level: int, fmt: str, *args) -> None:
        if level >= logging.WARNING and self._slot.is_retired(self._cell[0] if self._cell else None):
            level = logging.INFO
        self._inner.log(level, fmt, *args)
