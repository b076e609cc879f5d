"""The connection-mode matrix of test_tracker_modes.py again, every connection through the real
PgBouncer in transaction pooling mode (Debian's 1.18: no protocol-level prepared statements, so
the callers connect with prepare_threshold=None, as docs/howto/psycopg.md says)."""

from __future__ import annotations

import asyncio

import pytest
from test_tracker_modes import ASYNC_MODES, OPS, OUTCOMES, SYNC_MODES, _async_cell, _sync_cell, poisoned  # noqa: F401

NO_PREPARE = {"prepare_threshold": None}
# prepare_threshold=0 prepares every statement: PgBouncer 1.18 cannot carry that (see docs/howto/psycopg.md).
POOLABLE_SYNC = [m for m in SYNC_MODES if m != "always_prepare"]

pytestmark = pytest.mark.xdist_group("pgbouncer")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", POOLABLE_SYNC)
def test_sync_face_through_pgbouncer(pgbouncer_dsn, poisoned, mode, op):
    for outcome in OUTCOMES:
        _sync_cell(pgbouncer_dsn, poisoned, mode, op, outcome, NO_PREPARE)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ASYNC_MODES)
def test_async_face_through_pgbouncer(pgbouncer_dsn, poisoned, mode, op):
    for outcome in OUTCOMES:
        asyncio.run(_async_cell(pgbouncer_dsn, poisoned, mode, op, outcome, NO_PREPARE))
