"""The code examples of the README and the documentation, found and run as a reader would run them.

Every fenced block whose language is `python`, `sql`, `sh`, `bash`, `console`, `javascript`/`js`
(Node, CommonJS), `go` or `java` is an example. A block is run alone (a fresh process), so an
example must be whole: its imports, and connection strings of the local services; a Go or Java
block is a whole program (`package main`, or a class with a `main` method). Two HTML comments on
the line right above a fence change that:

    <!-- example: not run (a reason the reader can check) -->   the block is shown, not run
    <!-- example: page -->   the page's examples of this language run in order in one process
                             (a tutorial whose steps build on each other), starting at this one;
                             not for Go or Java, whose blocks are whole programs
    <!-- example: background -->   a shell block that keeps running (a server) while the page's
                             later examples run, stopped with SIGTERM when the page ends; a page
                             with one runs as a whole, its examples in order

Blocks in any other language (`text`, `json`, `yaml`, ...) are output or configuration, not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

RUN = {
    "python": "python",
    "sql": "sql",
    "sh": "sh",
    "bash": "sh",
    "console": "sh",
    "javascript": "node",
    "js": "node",
    "go": "go",
    "java": "java",
}
# Each block is a whole program: steps of a page cannot be joined into one.
WHOLE_PROGRAMS = {"go", "java"}
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
_DIRECTIVE = re.compile(r"^<!--\s*example:\s*(?P<what>not run|page|background)\b\s*(?P<why>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    path: Path
    line: int  # of the opening fence, 1-based
    language: str  # a value of RUN: python, sql, sh, node, go or java
    code: str
    not_run: str | None  # the reason, when shown only
    page: bool  # runs after the page's earlier examples of its language, in one process
    background: bool = False  # keeps running while the page's later examples run

    def name(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.line}"


def examples(path: Path) -> list[Example]:
    """The runnable examples of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    found: list[Example] = []
    page_from: set[str] = set()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening.group("fence"), opening.group("info").strip()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        language = RUN.get(info.split(" ", 1)[0].strip("{}") if info else "")
        directive = _DIRECTIVE.match(lines[i - 1].strip()) if i > 0 else None
        if directive and directive.group("what") == "not run" and not directive.group("why").strip("() "):
            raise ValueError(f"{path}:{i}: `example: not run` needs a reason the reader can check")
        if directive and directive.group("what") == "background" and language != "sh":
            raise ValueError(f"{path}:{i}: only a shell block can run in the background")
        if directive and directive.group("what") == "page" and language in WHOLE_PROGRAMS:
            raise ValueError(f"{path}:{i}: a {language} block is a whole program and cannot be a page's step")
        if language:
            if directive and directive.group("what") == "page":
                page_from.add(language)
            indent = len(opening.group("indent"))
            code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
            if info.split(" ", 1)[0].strip("{}") == "console":
                code = shell_commands(code)  # what runs: the commands, not the output shown
            found.append(
                Example(
                    path=path,
                    line=i + 1,
                    language=language,
                    code=code,
                    not_run=directive.group("why").strip("() ")
                    if directive and directive.group("what") == "not run"
                    else None,
                    page=language in page_from,
                    background=bool(directive and directive.group("what") == "background"),
                )
            )
        elif directive:
            raise ValueError(f"{path}:{i}: an example directive above a block that is not an example ({info!r})")
        i = end + 1
    return found


def shell_commands(code: str) -> str:
    """A `console` block's commands: lines after a `$ ` prompt (output lines are not run). The
    collector keeps only these of a console block, so blocks joined into one script (a page) keep
    every line of their other shell blocks."""
    prompted = [line[2:] for line in code.splitlines() if line.startswith("$ ")]
    return "\n".join(prompted) + "\n" if prompted else code
