"""What every driver shares: how a call is made all-or-nothing, and its step loop, without I/O.

A driver runs a core operation (tracker/core/steps.py) as one call inside the caller's transaction:

- `boundary()` picks how the call begins and ends (a savepoint of the caller's transaction, or a
  transaction of its own when there is none) from the connection's mode and transaction status;
- `frame(op, edge)` wraps the operation: it adds the boundary's statements to the operation's
  rounds (the start to the first round, the end to the last one, so they cost no round trip of
  their own where the driver pipelines), and on any failure closes the operation and asks for
  the undo. It does no I/O: it yields what to do (`Round`, `Write`, `Effect`, and `Begin` /
  `Undo` below) and receives the results;
- `drive` / `drive_async` feed a frame to a driver's I/O calls: the one part each driver writes
  for itself (sync_psycopg.py, async_psycopg.py, async_asyncpg.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union

from psycopg import pq

from tracker.core.steps import Effect, Op, Query, Round, Write
from tracker.errors import CallerTransactionAborted, NoCallerTransaction

T = TypeVar("T")
C = TypeVar("C")
# Each call's savepoint has a name of its own: a call nested in another's effect (exactly_once)
# can never roll back, or release, the outer call's savepoint.
_CALLS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Boundary:
    """How a call begins and ends: a savepoint of the caller's transaction, named `savepoint`, or
    (`savepoint` None) a transaction of the call's own."""

    start: str
    end: str
    savepoint: str | None = None

    @property
    def undo(self) -> tuple[str, ...]:
        """Roll the call back, when its start is known to have run and its end not."""
        if self.savepoint is None:
            return ("ROLLBACK",)
        return ("ROLLBACK TO SAVEPOINT " + self.savepoint, "RELEASE SAVEPOINT " + self.savepoint)

    @property
    def probe(self) -> str:
        """A savepoint made before rolling back to the call's own when that one may be gone (its
        end ran, or its start never did): if rolling back to the call's fails, rolling back to the
        probe undoes that failure alone (`unprobe`), and the caller's transaction goes on."""
        return f"SAVEPOINT {self.savepoint}_probe"

    @property
    def unprobe(self) -> tuple[str, ...]:
        return (f"ROLLBACK TO SAVEPOINT {self.savepoint}_probe", f"RELEASE SAVEPOINT {self.savepoint}_probe")


OWN_TRANSACTION = Boundary("BEGIN", "COMMIT")


def savepoint() -> Boundary:
    """A savepoint boundary with a name no other call of this process has."""
    name = f"tracker_call_{next(_CALLS)}"
    return Boundary("SAVEPOINT " + name, "RELEASE SAVEPOINT " + name, name)


def boundary(autocommit: bool, status: pq.TransactionStatus) -> Boundary:
    """How a call is made all-or-nothing, from the connection's mode and transaction status."""
    if status == pq.TransactionStatus.INERROR:
        raise CallerTransactionAborted()
    if status == pq.TransactionStatus.IDLE and autocommit:
        return OWN_TRANSACTION
    return savepoint()


def inside(edge: Boundary, within: str | None) -> Boundary:
    """`edge`, unless `within` names a call that only holds inside the caller's transaction and
    there is none (the call would be a transaction of its own): NoCallerTransaction, nothing sent."""
    if within is not None and edge.savepoint is None:
        raise NoCallerTransaction(within)
    return edge


@dataclass(frozen=True, slots=True)
class Begin:
    """Send the boundary's start alone (before a `Write`, or on a driver that does not pipeline).
    A failure here means nothing of the call was sent: there is nothing to undo."""

    sql: str


@dataclass(frozen=True, slots=True)
class Undo:
    """The call failed after it began: roll it back to where it began (if the connection and the
    transaction are still there). `unsure`: the failure came while the boundary's start or end was
    on its way (an interruption: a cancellation, Ctrl-C), so the server may have run it or not; a
    savepoint is then rolled back to behind a probe (`Boundary.probe`). If the call's end had run,
    its work stands, released into the caller's transaction like any statement of the caller's that
    completed, and the call still raises its interruption."""

    edge: Boundary
    unsure: bool = False


Io = Union[Round, Write, Effect, Begin, Undo]
# A framed call: yields what to do, receives a Round's results (None for the others), returns the
# operation's result.
Frame = Generator[Io, Any, T]


def _undo(edge: Boundary, failure: BaseException, unsure: bool) -> Generator[Io, Any, None]:
    try:
        yield Undo(edge, unsure)
    except Exception as undo_failed:
        # The call's failure is what the caller must see (a cancellation above all: asyncio relies
        # on it); the undo's own error rides along as a note.
        failure.add_note(f"undoing the call failed too: {undo_failed!r}")


def _begin(edge: Boundary) -> Generator[Io, Any, bool]:
    """Begin alone. If the server refused it (an `Exception`), nothing of the call ran, so there is
    nothing to undo. An interruption (a cancellation, Ctrl-C) may land once the server ran it: a
    transaction of the call's own is rolled back (a ROLLBACK with no transaction open changes
    nothing), or the connection would stay inside a transaction nobody ends; a savepoint is rolled
    back to behind a probe (`Undo.unsure`), since it may never have been made."""
    try:
        yield Begin(edge.start)
    except BaseException as failure:
        if edge.savepoint is None or not isinstance(failure, Exception):
            yield from _undo(edge, failure, unsure=True)
        raise
    return True


def frame(op: Op[T], edge: Boundary, *, pipelined: bool = True) -> Frame[T]:
    """The call of `op` inside `edge`. `pipelined`: the driver sends a round's queries in one trip,
    so the start rides with the first round; otherwise it is sent alone (as `Begin`) first."""
    started = ended = False
    bounding = False  # a round carrying the boundary's start or end is on its way
    try:
        try:
            step = next(op)
        except StopIteration as done:  # nothing to send (e.g. an ack of no ids)
            return done.value
        while True:
            result: object = None
            if type(step) is Round:
                if not started and not pipelined:
                    started = yield from _begin(edge)
                if started:
                    if step.last:
                        bounding = True
                        results = yield Round(step.queries + (Query(edge.end),))
                        bounding = False
                        ended = True
                        result = results[:-1]
                    else:
                        result = yield step
                else:
                    started = bounding = True  # from here a failure must be undone, even in this round
                    suffix = (Query(edge.end),) if step.last else ()
                    results = yield Round((Query(edge.start),) + step.queries + suffix)
                    bounding = False
                    ended = step.last
                    result = results[1 : 1 + len(step.queries)]
            elif type(step) is Write:
                if not started:
                    started = yield from _begin(edge)
                yield step
            elif type(step) is Effect:
                result = yield step
            else:  # pragma: no cover - the core yields only the steps above
                raise TypeError(f"unknown step {step!r}")
            try:
                step = op.send(result)
            except StopIteration as done:
                if started and not ended:
                    bounding = True
                    yield Round((Query(edge.end),))
                return done.value
    except GeneratorExit:  # pragma: no cover - a driver always runs its frame to the end
        op.close()
        raise
    except BaseException as failure:
        op.close()
        if started and not ended:
            yield from _undo(edge, failure, bounding)
        raise


# A driver's I/O calls on its connection type C: (send a round -> one result per query, run a
# write, begin alone, undo). The effect is the caller's (no argument).
SyncIo = tuple[
    Callable[[C, Sequence[Query]], list[object]],
    Callable[[C, Write], None],
    Callable[[C, str], None],
    Callable[[C, Undo], None],
]
AsyncIo = tuple[
    Callable[[C, Sequence[Query]], Awaitable[list[object]]],
    Callable[[C, Write], Awaitable[None]],
    Callable[[C, str], Awaitable[None]],
    Callable[[C, Undo], Awaitable[None]],
]


def _no_effect() -> Any:
    raise RuntimeError("the operation asked for an effect but none was given")


async def _no_effect_async() -> Any:
    _no_effect()


# <sync drive: generated from the async region below by deploy/async_to_sync.py; do not edit>
def drive(calls: Frame[T], conn: C, io: SyncIo[C], effect: Callable[[], object] | None) -> T:
    """Run a frame's I/O with a driver's calls. A failure of an I/O call is thrown into the frame,
    which asks for the undo and raises it again."""
    send, write, begin, undo = io
    call_effect = effect or _no_effect
    try:
        step = next(calls)
        while True:
            try:
                result: object = None
                if type(step) is Round:
                    result = send(conn, step.queries)
                elif type(step) is Write:
                    write(conn, step)
                elif type(step) is Effect:
                    result = call_effect()
                elif type(step) is Begin:
                    begin(conn, step.sql)
                elif type(step) is Undo:
                    undo(conn, step)
            except BaseException as exc:
                step = calls.throw(exc)
            else:
                step = calls.send(result)
    except StopIteration as done:
        return done.value


# </sync drive>


# <async drive>
async def drive_async(calls: Frame[T], conn: C, io: AsyncIo[C], effect: Callable[[], Awaitable[object]] | None) -> T:
    """Run a frame's I/O with a driver's calls. A failure of an I/O call is thrown into the frame,
    which asks for the undo and raises it again."""
    send, write, begin, undo = io
    call_effect = effect or _no_effect_async
    try:
        step = next(calls)
        while True:
            try:
                result: object = None
                if type(step) is Round:
                    result = await send(conn, step.queries)
                elif type(step) is Write:
                    await write(conn, step)
                elif type(step) is Effect:
                    result = await call_effect()
                elif type(step) is Begin:
                    await begin(conn, step.sql)
                elif type(step) is Undo:
                    await undo(conn, step)
            except BaseException as exc:
                step = calls.throw(exc)
            else:
                step = calls.send(result)
    except StopIteration as done:
        return done.value


# </async drive>
