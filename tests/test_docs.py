"""The documentation site: built strictly (a warning or a broken internal link fails), reference
pages that match the code, and no internal references where users read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deploy import docs_reference  # noqa: E402
from tracker import errors  # noqa: E402

pytestmark = pytest.mark.xdist_group("docs")


def _build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(source), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_the_site_builds_without_a_warning(tmp_path):
    done = _build(REPO / "docs", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "reference" / "configuration.html").exists()
    assert (tmp_path / "site" / "openapi.json").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    """The strictness the site relies on: a link to a missing page or heading is an error."""
    copy = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(REPO / "docs"), str(copy)], check=True)
    conf = copy / "conf.py"
    conf.write_text(conf.read_text().replace('"../harvester/', f'"{REPO}/harvester/'))
    page = copy / "reference" / "cli.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md) and [there](errors.md#no-such-heading).\n")
    done = _build(copy, tmp_path / "site")
    assert done.returncode != 0
    assert "no-such-page.md" in done.stderr and "no-such-heading" in done.stderr


def test_reference_pages_match_the_code():
    stale = docs_reference.stale_pages()
    assert not stale, f"out of date: {sorted(p.name for p in stale)}; run .venv/bin/python deploy/docs_reference.py"


def test_every_sqlstate_the_sql_raises_is_documented_with_its_python_error():
    raised = set()
    for path in (REPO / "sql").glob("*.sql"):
        raised |= set(re.findall(r"'(RT\d{3})'", path.read_text()))
    assert raised == set(errors.SQLSTATES), (raised, set(errors.SQLSTATES))
    for meaning, classes in errors.SQLSTATES.values():
        assert meaning and classes and all(issubclass(c, errors.TrackerError) for c in classes)


def test_the_readme_is_short_and_every_link_in_it_resolves():
    """A newcomer's page: the set-up commands, what and why, a quick start, the comparison in brief,
    and links into the documentation, each to a file that exists."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings[:1] == ["Quick start"] and {"How it compares", "Documentation"} <= set(headings), headings
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+:", t)]
    assert len(local) >= 30, local
    missing = [t for t in local if not (REPO / t).exists()]
    assert not missing, missing


USER_FACING = ["README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md", "docs"]


def _user_facing_text() -> list[tuple[Path, str]]:
    files: list[Path] = []
    for name in USER_FACING:
        path = REPO / name
        files += sorted(path.rglob("*.md")) if path.is_dir() else [path]
    return [(f, f.read_text()) for f in files]


def test_no_internal_references_where_users_read():
    bad = []
    for path, text in _user_facing_text():
        for pattern in (r"\bissues? #?\d+\b", r"\.\./shared\b", r"DESIGN\.md", r"/work/"):
            bad += [f"{path.relative_to(REPO)}: {m.group(0)!r}" for m in re.finditer(pattern, text, re.IGNORECASE)]
    assert not bad, bad


def test_sql_reference_matches_the_functions_the_database_holds(conn, schema):
    """Each documented function exists with the documented arguments, and its comment in the
    database (what `\\df+` shows) is the page's text."""
    documented = docs_reference.sql_functions()
    rows = conn.execute(
        "SELECT p.proname, pg_get_function_arguments(p.oid), obj_description(p.oid, 'pg_proc') "
        "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s AND p.proname = ANY(%s)",
        [schema, list(documented)],
    ).fetchall()
    found = {name: (args, comment) for name, args, comment in rows}
    assert set(found) == set(documented) and len(rows) == len(documented), "one function each, none missing"
    for name, (header, comment) in documented.items():
        args, in_db = found[name]
        assert in_db == comment, name
        declared = header[len(name) + 1 : header.index(") RETURNS")]
        assert _normalized(args, cast=True) == _normalized(declared), name


def _normalized(arguments: str, cast: bool = False) -> str:
    """An argument list as one comparable string: the catalog writes defaults with their casts
    (`NULL::text`) and float8 by its long name."""
    text = re.sub(r"\s+", " ", arguments.replace("float8", "double precision")).lower()
    return re.sub(r"::[a-z ]+?(\[\])?(?=,|$)", "", text) if cast else text


def test_every_alert_has_a_runbook_and_every_runbook_an_alert(tmp_path):
    books = docs_reference.load_module("reaper_runbooks", REPO / "deploy" / "prometheus" / "runbooks.py").RUNBOOKS
    _, alerts = docs_reference.load_module("reaper_rules", REPO / "deploy" / "prometheus" / "rules.py").rules()
    assert [a.alert for a in alerts] == [a.alert for a in alerts if a.alert in books] and len(books) == len(alerts)
    for book in books.values():
        assert book.means and book.check and book.act
