"""Reproduction: the previous release's code (a consumer or producer not yet redeployed) against a
schema `reaper migrate` upgraded to outcomes. It completes batches through its own inline SQL,
which sets state 'complete' but no outcome, and writes the shared completion_event: a version 2
event with "outcome": null (README: "succeeded", "failed" or "expired"), and a batch that stays
complete with no outcome.

    OLD_TREE=<checkout of the previous release, with its .venv> python -m bench.outcomes_old_code
    # needs OUTBOX_TEST_DSN
"""

import json
import os
import subprocess
import uuid

import psycopg

from tracker import schema as schema_mod  # this branch

dsn = os.environ["OUTBOX_TEST_DSN"]
OLD = os.environ["OLD_TREE"]
name = f"t_{uuid.uuid4().hex[:12]}"
schema_mod.migrate(dsn, name)
old = r"""
import sys, psycopg, tracker
dsn, name = sys.argv[1:3]
with psycopg.connect(dsn) as c:
    for how in ("masked", "close"):
        b = tracker.open_batch(c, schema=name); g = tracker.add_items(c, b, 1, schema=name)
        if how == "masked":
            tracker.close_batch(c, b, schema=name); tracker.ack(c, [f"{b.id}:{g[0].group_id}:0"], claims=False, schema=name)
        else:
            tracker.ack(c, [f"{b.id}:{g[0].group_id}:0"], claims=False, schema=name); tracker.close_batch(c, b, schema=name)
        c.commit()
"""
try:
    r = subprocess.run(
        [os.path.join(OLD, ".venv/bin/python"), "-c", old, dsn, name],
        env={**os.environ, "PYTHONPATH": OLD},
        capture_output=True,
        text=True,
        cwd=OLD,
    )
    print(r.returncode, r.stderr[-500:])
    with psycopg.connect(dsn) as c:
        for row in c.execute(f'SELECT id, state, outcome FROM "{name}".batch ORDER BY id').fetchall():
            print(row)
        for (v,) in c.execute(f"SELECT convert_from(value, 'UTF8') FROM \"{name}\".outbox ORDER BY id").fetchall():
            print(json.loads(v).get("outcome", "<no key>"), json.loads(v).get("schema_version"))
finally:
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
