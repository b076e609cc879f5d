"""The README's quick start works when copied as written (on this test's schema), and the
operations page's storage table matches the migrated schema."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
from psycopg import sql

REPO = Path(__file__).resolve().parents[1]


def quick_start_code() -> str:
    """The quick start's Python example."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return code


def test_readme_quick_start_runs_as_written(pg_dsn, schema, capsys):
    """Run on this test's own schema (the documentation's runner runs it as written, on `reaper`),
    so what it leaves can be checked exactly: one batch completed, its items and one completion
    event in the outbox."""
    code = quick_start_code()
    assert 'tracker.Tracker(schema="reaper")' in code
    assert "postgresql://postgres@127.0.0.1:55432/outbox" in code
    code = code.replace('tracker.Tracker(schema="reaper")', f'tracker.Tracker(schema="{schema}")')
    code = code.replace("postgresql://postgres@127.0.0.1:55432/outbox", pg_dsn)
    exec(compile(code, "README.md quick start", "exec"), {})
    assert capsys.readouterr().out.strip() == "complete"
    with psycopg.connect(pg_dsn) as conn:
        batches = conn.execute(
            sql.SQL("SELECT state, total, pending, user_key FROM {} ORDER BY id").format(
                sql.Identifier(schema, "batch")
            )
        ).fetchall()
        topics = conn.execute(
            sql.SQL("SELECT topic, count(*) FROM {} GROUP BY topic ORDER BY topic").format(
                sql.Identifier(schema, "outbox")
            )
        ).fetchall()
    assert batches == [("complete", 1_000, 0, "catalog-42")]
    assert topics == [("batch-completions", 1), ("process-item", 1_000)]


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


def test_the_metrics_page_lists_exactly_the_exported_metrics():
    from prometheus_client import CollectorRegistry
    from test_prometheus_rules import CONTRACT_METRICS

    from harvester.services.http.observe import HttpMetrics

    # reaper run's, and reaper serve's own (on its port)
    scratch = CollectorRegistry()
    HttpMetrics("reaper", scratch)
    served = {f.name + ("_total" if f.type == "counter" else "") for f in scratch.collect()}
    page = (REPO / "docs" / "reference" / "metrics.md").read_text()
    listed = {m.group(1) for m in re.finditer(r"^\| `(reaper_\w+)` \| (?:gauge|counter|histogram) \|", page, re.M)}
    assert served and listed == CONTRACT_METRICS | served
