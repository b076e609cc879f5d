"""The README's application quick start works when copied as written (on this test's schema), and the
operations page's storage table matches the migrated schema."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import yaml
from psycopg import sql

REPO = Path(__file__).resolve().parents[1]


def quick_start_code() -> str:
    """The quick start's two examples (psycopg, then SQLAlchemy), as one program."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start: application code", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, blocks
    return "\n".join(blocks)


def test_readme_quick_start_runs_as_written(pg_dsn, schema):
    code = quick_start_code()
    assert 'tracker.Tracker(schema="reaper"' in code
    assert "postgresql://postgres@127.0.0.1:55432/outbox" in code
    code = code.replace('tracker.Tracker(schema="reaper"', f'tracker.Tracker(schema="{schema}"')
    assert "postgresql+psycopg://postgres@127.0.0.1:55432/outbox" in code
    code = code.replace("postgresql://postgres@127.0.0.1:55432/outbox", pg_dsn)
    code = code.replace(
        "postgresql+psycopg://postgres@127.0.0.1:55432/outbox", pg_dsn.replace("postgresql://", "postgresql+psycopg://")
    )
    exec(compile(code, "README.md quick start", "exec"), {})
    with psycopg.connect(pg_dsn) as conn:
        batches = conn.execute(
            sql.SQL("SELECT state, total, pending, user_key, completion_topic FROM {} ORDER BY id").format(
                sql.Identifier(schema, "batch")
            )
        ).fetchall()
        rows, with_ids = conn.execute(
            sql.SQL(
                "SELECT count(*), count(*) FILTER (WHERE 'item-id' = ANY(header_keys)) FROM {} WHERE topic = 'process-item'"
            ).format(sql.Identifier(schema, "outbox"))
        ).fetchone()
    assert batches == [("closed", 100_000, 100_000, "catalog-42", None), ("closed", 2, 2, "catalog-43", "catalog-done")]
    assert rows == with_ids == 100_002


def test_readme_asyncio_quick_start_runs_as_written(pg_dsn, schema):
    import asyncio

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start: asyncio", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'AsyncTracker(schema="reaper")' in code
    code = code.replace('AsyncTracker(schema="reaper")', f'AsyncTracker(schema="{schema}")')
    code = code.replace(
        "postgresql+psycopg://postgres@127.0.0.1:55432/outbox", pg_dsn.replace("postgresql://", "postgresql+psycopg://")
    )
    namespace: dict = {}
    exec(compile(code, "README.md asyncio quick start", "exec"), namespace)
    asyncio.run(namespace["main"]())
    with psycopg.connect(pg_dsn) as conn:
        batches = conn.execute(
            sql.SQL("SELECT state, total, user_key FROM {}").format(sql.Identifier(schema, "batch"))
        ).fetchall()
        rows = conn.execute(
            sql.SQL("SELECT count(*) FROM {} WHERE topic = 'process-item'").format(sql.Identifier(schema, "outbox"))
        ).fetchone()[0]
    assert batches == [("closed", 1_000, "catalog-44")] and rows == 1_000


def test_operations_page_storage_table_matches_the_migrated_schema(pg_dsn, schema):
    page = (REPO / "docs" / "howto" / "operations.md").read_text()
    section = page.split("## Vacuum and table bloat", 1)[1].split("\n## ", 1)[0]
    documented = {
        m.group(1): (int(m.group(2)), m.group(3).strip())
        for m in re.finditer(r"^\| `(\w+)` \| (\d+) \| ([^|]*)\|", section, re.M)
    }
    assert set(documented) == {"outbox", "batch", "batch_group"}, documented
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT c.relname, c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname = ANY(%s)",
            [schema, list(documented)],
        ).fetchall()
    assert len(rows) == 3
    for name, options in rows:
        settings = dict(o.split("=", 1) for o in options or [])
        fillfactor, autovacuum = documented[name]
        assert int(settings.get("fillfactor", 100)) == fillfactor, (name, settings)
        if autovacuum.startswith("by row count"):
            assert settings.get("autovacuum_vacuum_scale_factor") == "0", (name, settings)
            for number in re.findall(r"([\d,]+) dead", autovacuum):
                assert settings.get("autovacuum_vacuum_threshold") == number.replace(",", ""), (name, settings)
        else:
            assert autovacuum == "default" and not any(k.startswith("autovacuum") for k in settings), (name, settings)


def test_readme_metrics_reference_lists_exactly_the_exported_metrics():
    from test_prometheus_rules import CONTRACT_METRICS

    readme = (REPO / "README.md").read_text()
    section = readme.split("## Metrics reference", 1)[1].split("\n## ", 1)[0]
    listed = {
        m.group(1)
        for m in re.finditer(r"^\| `(reaper_\w+)(?:\{\w+\})?` \| (?:gauge|counter|histogram) \|", section, re.M)
    }
    assert listed == CONTRACT_METRICS
    alerts = set(re.findall(r"^\| `(Reaper\w+)`", section, re.M))
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "rules.yml").read_text())
    defined = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    assert alerts == defined - {"ReaperOutboxBacklogVeryOld"}  # listed together with ...Old
