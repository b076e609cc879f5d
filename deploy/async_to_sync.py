#!/usr/bin/env python3
"""The tracker's sync code, generated from its asyncio code (the way psycopg keeps its two faces).

    .venv/bin/python deploy/async_to_sync.py          # rewrite the generated regions
    .venv/bin/python deploy/async_to_sync.py --check  # exit 1 if one is out of date

A source region `# <async NAME>` ... `# </async NAME>` becomes the target region `# <sync NAME ...>`
... `# </sync NAME>` with `async def/with/for` made plain, `await` dropped, `Awaitable[X]` made
`X` and the names in RENAME replaced (also in docstrings). The target file is then formatted with
ruff. Only the generated regions are rewritten; what differs between the faces (how a session
becomes a connection, how an effect is called) is written by hand outside them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (source file, region name, target file)
REGIONS = [
    ("tracker/drivers/calls.py", "drive", "tracker/drivers/calls.py"),
    ("tracker/drivers/async_psycopg.py", "psycopg", "tracker/drivers/sync_psycopg.py"),
    ("tracker/aio.py", "face", "tracker/sync.py"),
    ("tracker/inbox/aio.py", "inbox", "tracker/inbox/sync.py"),
]

RENAME = {
    "AsyncTracker": "Tracker",
    "AsyncInbox": "Inbox",
    "AsyncSession": "SyncSession",
    "AsyncEffect": "SyncEffect",
    "AsyncIo": "SyncIo",
    "AsyncConnection": "Connection",
    "AsyncCursor": "Cursor",
    "drive_async": "drive",
    "_no_effect_async": "_no_effect",
    "async_connection": "sync_connection",
}
_NAMES = re.compile(r"\b(" + "|".join(map(re.escape, RENAME)) + r")\b")
_AWAITABLE = re.compile(r"\bAwaitable\[(\w+)\]")


def to_sync(text: str) -> str:
    text = re.sub(r"\basync (def|with|for)\b", r"\1", text)
    text = re.sub(r"\bawait ", "", text)
    text = _AWAITABLE.sub(r"\1", text)
    return _NAMES.sub(lambda m: RENAME[m.group(1)], text)


def _region(text: str, start: str, end: str, where: str) -> tuple[int, int]:
    """(offset after the start marker's line, offset of the end marker's line)."""
    i = text.find(start)
    j = text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"{where}: no region {start!r} ... {end!r}")
    return text.index("\n", i) + 1, j


def _format(path: Path, text: str) -> str:
    ruff = [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(path), "-"]
    return subprocess.run(ruff, input=text, capture_output=True, text=True, check=True, cwd=REPO).stdout


def generated() -> dict[Path, str]:
    """The text every target file should have."""
    out: dict[Path, str] = {}
    for source, name, target in REGIONS:
        src = (REPO / source).read_text()
        a, b = _region(src, f"# <async {name}>", f"# </async {name}>", source)
        path = REPO / target
        text = out.get(path) or path.read_text()
        c, d = _region(text, f"# <sync {name}", f"# </sync {name}>", target)
        out[path] = text[:c] + to_sync(src[a:b]) + text[d:]
    return {path: _format(path, text) for path, text in out.items()}


def main(argv: list[str]) -> int:
    stale = []
    for path, text in generated().items():
        if path.read_text() != text:
            stale.append(path.relative_to(REPO))
            if "--check" not in argv:
                path.write_text(text)
    if stale and "--check" in argv:
        print(f"out of date (run deploy/async_to_sync.py): {', '.join(map(str, stale))}", file=sys.stderr)
        return 1
    for path in stale:
        print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
