"""The sync and asyncio faces cannot drift: same public methods and functions, same parameters
(kinds and defaults included), docstrings everywhere; the generated sync code is up to date; the
shared step loop (tracker/drivers/calls.py) frames calls the same way for every driver. No database."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

import tracker
from tracker import aio, consumer, outbox, sync
from tracker.core.steps import Effect, Query, Round, Write
from tracker.drivers.calls import Begin, Undo, frame, savepoint

REPO = Path(__file__).resolve().parents[1]


def _params(fn: object) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def drift(sync_fns: dict[str, object], async_fns: dict[str, object]) -> list[str]:
    """Every difference between two faces' public callables (name -> function)."""
    out = []
    for name in sorted(set(sync_fns) ^ set(async_fns)):
        out.append(f"{name}: only on the {'sync' if name in sync_fns else 'asyncio'} face")
    for name in sorted(set(sync_fns) & set(async_fns)):
        s, a = sync_fns[name], async_fns[name]
        if _params(s) != _params(a):
            out.append(f"{name}: parameters differ: {_params(s)} != {_params(a)}")
        for face, fn in (("sync", s), ("asyncio", a)):
            if not (inspect.getdoc(fn) or "").strip():
                out.append(f"{name}: no docstring on the {face} face")
        if inspect.iscoroutinefunction(s) or not inspect.iscoroutinefunction(a):
            out.append(f"{name}: the sync face's must be plain, the asyncio face's a coroutine function")
    return out


def _methods(cls: type) -> dict[str, object]:
    return {n: f for n, f in vars(cls).items() if not n.startswith("_") and callable(f)}


def _functions(module: object, names: list[str]) -> dict[str, object]:
    return {n: getattr(module, n) for n in names if hasattr(module, n)}


FUNCTIONS = [n for n in aio.__all__ if n not in ("AsyncTracker", "default")]


def test_the_tracker_classes_agree() -> None:
    assert _methods(sync.Tracker) and drift(_methods(sync.Tracker), _methods(aio.AsyncTracker)) == []


def test_the_module_level_functions_agree() -> None:
    assert set(FUNCTIONS) >= {"enqueue", "ack", "apply_masks", "exactly_once"}
    assert drift(_functions(sync, FUNCTIONS), _functions(aio, FUNCTIONS)) == []
    # each function takes its method's parameters plus schema=
    for name in FUNCTIONS:
        method = [p for p in _params(getattr(sync.Tracker, name)) if p[0] != "self"]
        assert [p for p in _params(getattr(sync, name)) if p[0] != "schema"] == method, name


def test_the_public_names_are_the_sync_faces() -> None:
    assert outbox.enqueue is sync.enqueue
    assert consumer.exactly_once is sync.exactly_once is tracker.exactly_once
    assert tracker.ack is sync.ack and tracker.Tracker is sync.Tracker


def test_the_drift_check_finds_drift() -> None:
    """The drift the faces once had: an asyncio apply_masks without skip_locked, and no docstring."""

    class Sync:
        def apply_masks(self, session, masks, *, reject_invalid=False, skip_locked=False):  # noqa: ANN001
            """Apply masks."""

        def status(self, session, batch):  # noqa: ANN001
            """Status."""

    class Async:
        async def apply_masks(self, session, masks, *, reject_invalid=False):  # noqa: ANN001
            pass

        async def status(self, session, batch=None):  # noqa: ANN001
            """Status."""

        async def extra(self):  # noqa: ANN201
            """Only here."""

    found = drift(_methods(Sync), _methods(Async))
    assert any(f.startswith("apply_masks: parameters differ") for f in found)
    assert "apply_masks: no docstring on the asyncio face" in found
    assert any(f.startswith("status: parameters differ") for f in found)
    assert "extra: only on the asyncio face" in found


def test_the_generated_sync_code_is_up_to_date() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "deploy" / "async_to_sync.py"), "--check"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_to_sync_rewrites_what_differs() -> None:
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        from async_to_sync import to_sync
    finally:
        sys.path.remove(str(REPO / "deploy"))
    src = "async def f(s: AsyncSession) -> Awaitable[int]:\n    async with c.pipeline():\n        return await g()\n"
    assert to_sync(src) == "def f(s: SyncSession) -> int:\n    with c.pipeline():\n        return g()\n"


# ---------------------------------------------------------------- the shared step loop, without I/O


def _op(fail_after: int = 99):
    rows = yield Round((Query("q1", fetch="one"),))
    assert rows == ["r1"]
    if fail_after == 1:
        raise ValueError("op failed")
    yield Write("copy", lambda: [], "insert", lambda: [])
    value = yield Effect()
    (row,) = yield Round((Query("q2", fetch="one"),), last=True)
    return value, row


SAVEPOINT = savepoint()


def _trace(
    pipelined: bool, fail_at: type | None = None, fail_after: int = 99, failure: BaseException | None = None
) -> list[object]:
    """The frame's requests, answering each Round with one result per query; `fail_at`: the first
    request of that type fails (with `failure`, by default a RuntimeError)."""
    calls = frame(_op(fail_after), SAVEPOINT, pipelined=pipelined)
    seen: list[object] = []
    reply: object = None
    step = next(calls)
    while True:
        seen.append(step)
        try:
            if fail_at is not None and type(step) is fail_at:
                fail_at = None
                step = calls.throw(failure or RuntimeError("io failed"))
                continue
            if type(step) is Round:
                reply = [f"r{q.sql[-1]}" if q.sql.startswith("q") else None for q in step.queries]
            else:
                reply = "effect" if type(step) is Effect else None
            step = calls.send(reply)
        except StopIteration as done:
            seen.append(("result", done.value))
            return seen
        except (RuntimeError, ValueError, KeyboardInterrupt) as exc:
            seen.append(("raised", str(exc)))
            return seen


def test_frame_rides_the_boundary_on_the_rounds_when_pipelined() -> None:
    seen = _trace(pipelined=True)
    assert [q.sql for q in seen[0].queries] == [SAVEPOINT.start, "q1"]
    assert type(seen[1]) is Write and type(seen[2]) is Effect
    assert [q.sql for q in seen[3].queries] == ["q2", SAVEPOINT.end]
    assert seen[-1] == ("result", ("effect", "r2"))


def test_frame_begins_alone_when_not_pipelined_and_undoes_a_failure() -> None:
    seen = _trace(pipelined=False, fail_at=Effect)
    assert seen[0] == Begin(SAVEPOINT.start)
    assert [q.sql for q in seen[1].queries] == ["q1"]
    assert Undo(SAVEPOINT, unsure=False) in seen and seen[-1] == ("raised", "io failed")


@pytest.mark.parametrize("pipelined", [True, False])
def test_frame_undoes_an_operation_error_but_not_a_failed_begin(pipelined: bool) -> None:
    seen = _trace(pipelined, fail_after=1)
    assert seen[-2:] == [Undo(SAVEPOINT, unsure=False), ("raised", "op failed")]
    if not pipelined:  # the caller's transaction refused the start: nothing to undo
        seen = _trace(pipelined, fail_at=Begin)
        assert seen == [Begin(SAVEPOINT.start), ("raised", "io failed")]


@pytest.mark.parametrize("pipelined", [True, False])
def test_frame_undoes_an_interruption_of_the_boundary_behind_a_probe(pipelined: bool) -> None:
    """Interrupted while the round carrying the start (pipelined) or the end was on its way, or at
    the start sent alone: the server may have run it or not, so the undo is `unsure`; interrupted
    elsewhere, the savepoint is known to be there."""
    stop = KeyboardInterrupt("stop")
    seen = _trace(pipelined, fail_at=Round, failure=stop)  # the first round: the start rides it when pipelined
    assert seen[-2:] == [Undo(SAVEPOINT, unsure=pipelined), ("raised", "stop")]
    seen = _trace(pipelined, fail_at=Effect, failure=stop)
    assert seen[-2:] == [Undo(SAVEPOINT, unsure=False), ("raised", "stop")]
    if not pipelined:
        seen = _trace(pipelined, fail_at=Begin, failure=stop)
        assert seen == [Begin(SAVEPOINT.start), Undo(SAVEPOINT, unsure=True), ("raised", "stop")]


def test_frame_undoes_an_interruption_of_the_last_round_behind_a_probe() -> None:
    calls = frame(_op(), SAVEPOINT)
    step = calls.send(None)
    step = calls.send([None, "r1"])  # the Write
    step = calls.send(None)  # the Effect
    step = calls.send("effect")  # the last round, carrying the end
    assert [q.sql for q in step.queries] == ["q2", SAVEPOINT.end]
    assert calls.throw(KeyboardInterrupt()) == Undo(SAVEPOINT, unsure=True)
    with pytest.raises(KeyboardInterrupt):
        calls.send(None)


def test_every_call_has_a_savepoint_of_its_own() -> None:
    names = {savepoint().savepoint for _ in range(1000)}
    assert len(names) == 1000
    assert all(n is not None and n.isidentifier() for n in names)


def test_renamed_names_keep_their_article() -> None:
    """`an AsyncTracker` must not become `an Tracker` in the sync face's docstrings."""
    sys.path.insert(0, str(REPO / "deploy"))
    try:
        from async_to_sync import REGIONS, RENAME
    finally:
        sys.path.remove(str(REPO / "deploy"))
    consonant = [v for v in RENAME.values() if v[0].lower() not in "aeiou_"]
    for target in {t for _s, _n, t in REGIONS}:
        text = (REPO / target).read_text()
        for name in consonant:
            assert f"an {name}" not in text, (target, name)
