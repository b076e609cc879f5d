"""Helpers shared by the tracker tests (no tests here): a whole-schema snapshot, the invariant-1 check."""

from __future__ import annotations

import psycopg


def snapshot(conn: psycopg.Connection, schema: str) -> dict[str, list[tuple]]:
    """Every row the tracker can touch, for "nothing changed" assertions."""
    s = f'"{schema}"'
    return {
        "batch": conn.execute(f"SELECT * FROM {s}.batch ORDER BY id").fetchall(),
        "batch_group": conn.execute(f"SELECT * FROM {s}.batch_group ORDER BY batch_id, id").fetchall(),
        "outbox": conn.execute(f"SELECT * FROM {s}.outbox ORDER BY id").fetchall(),
        "group_failure": conn.execute(f"SELECT * FROM {s}.group_failure ORDER BY 1, 2, 3").fetchall(),
        "failure_reason": conn.execute(f"SELECT * FROM {s}.failure_reason ORDER BY id").fetchall(),
    }


def invariant_violations(conn: psycopg.Connection, schema: str) -> list[tuple]:
    """Invariant 1: group.pending = bit_count(bits); batch.pending = sum(group.pending) and
    batch.failed = sum(group.failed), pending + failed <= total; plus the states that follow from it:
    complete <=> an outcome; closed with nothing pending and no child open => complete; finished
    with items pending (early, by a threshold) or never closed => failed; children_open = children
    not finished + finished children not yet folded in (child_finished rows)."""
    s = f'"{schema}"'
    return conn.execute(f"""
        SELECT 'group', g.batch_id, g.id, g.pending, bit_count(g.bits) FROM {s}.batch_group g
         WHERE g.pending <> bit_count(g.bits) OR bit_length(g.bits) <> g.size
        UNION ALL
        SELECT 'batch', b.id, NULL, b.pending, coalesce(sum(g.pending), 0) FROM {s}.batch b
          LEFT JOIN {s}.batch_group g ON g.batch_id = b.id
         GROUP BY b.id HAVING b.pending <> coalesce(sum(g.pending), 0) OR b.total <> coalesce(sum(g.size), 0)
            OR b.failed <> coalesce(sum(g.failed), 0)
        UNION ALL
        SELECT 'group counts', g.batch_id, g.id, g.pending, g.failed FROM {s}.batch_group g
         WHERE g.pending + g.failed > g.size
        UNION ALL
        SELECT 'state', b.id, NULL, b.pending, NULL FROM {s}.batch b
         WHERE (b.state = 'complete') <> (b.outcome IS NOT NULL)
            OR (b.state = 'closed' AND b.pending = 0 AND b.children_open = 0)
            OR (b.state = 'complete' AND (b.pending > 0 OR b.closed_at IS NULL) AND b.outcome <> 'failed')
            OR b.pending + b.failed > b.total
        UNION ALL
        SELECT 'children open', b.id, NULL, b.children_open, NULL FROM {s}.batch b
         WHERE b.children_open <> (SELECT count(*) FROM {s}.batch c WHERE c.parent_id = b.id AND c.state IN ('open', 'closed'))
                                + (SELECT count(*) FROM {s}.child_finished f WHERE f.parent_id = b.id)
        """).fetchall()


def completion_events(conn: psycopg.Connection, schema: str, topic: str = "batch-completions") -> list[tuple]:
    return conn.execute(f'SELECT key, value FROM "{schema}".outbox WHERE topic = %s ORDER BY id', [topic]).fetchall()
