"""Sphinx configuration of the documentation site (`make docs` serves it, `make test` builds it
strictly: a warning, a broken internal link or a page outside the table of contents fails)."""

from __future__ import annotations

from importlib import metadata

project = "outbox-reaper"
author = "the outbox-reaper authors"
copyright = "the outbox-reaper authors, Apache-2.0"  # noqa: A001 (Sphinx's name for it)
try:
    release = metadata.version("outbox-reaper")
except metadata.PackageNotFoundError:
    release = "unknown"

extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build", "_extra"]
# Headings get anchors so pages can link to a section (`page.md#a-section`), and a link to a
# section that does not exist is a warning, hence an error in the strict build.
myst_heading_anchors = 4
myst_enable_extensions = ["colon_fence", "deflist"]
nitpicky = True

html_theme = "furo"
html_title = f"outbox-reaper {release}"
html_static_path: list[str] = []
# Files served as they are: the OpenAPI document (as `reaper serve` serves it) and the events'
# JSON Schemas (docs/_extra/schemas, generated).
html_extra_path = ["../harvester/services/http/openapi.json", "_extra"]
version = release


def _psql_lexer() -> type:
    """`sql` blocks are run by psql (tests/test_docs_examples.py): highlight them as PostgreSQL
    (dollar quotes, `DO` blocks) plus psql's backslash commands (`\\gset`, `\\set`)."""
    from pygments.lexer import inherit
    from pygments.lexers.sql import PostgresLexer
    from pygments.token import Keyword

    class PsqlScriptLexer(PostgresLexer):
        name = "psql script"
        aliases: list[str] = []
        tokens = {"root": [(r"\\[A-Za-z?!]+[^\n]*", Keyword.Pseudo), inherit]}

    return PsqlScriptLexer


def setup(app) -> None:  # noqa: ANN001 (Sphinx's application object)
    app.add_lexer("sql", _psql_lexer())
