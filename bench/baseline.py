"""The code of an earlier commit, checked out once into a cache, for benchmarks that compare against it.

`checkout("7dffd89")` returns `.local/bench-baselines/<full sha>/`, a copy of that commit's tracked
files (`git archive`), built on first use through deploy/local/first_use.py: written into a private
folder, marked complete and renamed into place, behind a lock. Two benchmarks asking at once share
one copy; one interrupted midway leaves nothing that looks usable, and the next one removes its
remains. It is a plain copy rather than a registered `git worktree`: a registered worktree cannot
be renamed into place (git records its path) and an interrupted one leaves an entry behind in the
repository's git folder. Copies are never changed once complete; delete the folder to reclaim space.

The baseline runs with the same interpreter as the working tree unless told otherwise, with its
own folder first on PYTHONPATH. `dependency_mismatches` says whether that interpreter's installed
packages satisfy the baseline's declared dependencies; if not, the baseline may still run (most
changes are additions), or fail on import, and its error is shown: give it an interpreter of its
own then (`--baseline-python`, a venv with the baseline's dependencies installed).

`compare` is what every benchmark's `--baseline REF` runs: one script of the working tree, under
the working tree's code and under REF's, alternating (bench.pairs).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.pairs import Command, alternate, load_average, summary

REPO = Path(__file__).resolve().parents[1]
MARK = ".bench-commit"  # the full sha, written into every copy


def _first_use():
    """deploy/local/first_use.py (standard library only; deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("first_use", REPO / "deploy" / "local" / "first_use.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cache_dir() -> Path:
    """Where copies live: OUTBOX_BENCH_BASELINES, else .local/bench-baselines (ignored by git)."""
    return Path(os.environ.get("OUTBOX_BENCH_BASELINES") or REPO / ".local" / "bench-baselines")


def resolve(ref: str, repo: Path = REPO) -> str:
    """The full sha of the commit `ref` names (a branch, tag, sha, HEAD~1, ...)."""
    p = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode != 0 or not p.stdout.strip():
        raise ValueError(f"baseline {ref!r}: not a commit of the repository at {repo}")
    return p.stdout.strip()


def checkout(
    ref: str, *, repo: Path = REPO, cache: Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The folder holding commit `ref`'s files, made on first use (safe for concurrent and
    interrupted runs: see the module's docstring)."""
    sha = resolve(ref, repo)

    def build(folder: Path, pass_fds: tuple[int, ...]) -> None:
        p = subprocess.run(
            ["git", "-C", str(repo), "archive", "--format=tar", sha],
            capture_output=True,
            check=False,
            pass_fds=pass_fds,
        )
        if p.returncode != 0:
            raise RuntimeError(f"git archive {sha} failed: {p.stderr.decode(errors='replace')[-1000:]}")
        with tarfile.open(fileobj=io.BytesIO(p.stdout)) as tar:
            tar.extractall(folder, filter="data")
        (folder / MARK).write_text(sha + "\n")

    return _first_use().populate((cache or cache_dir()) / sha, build, log=log)


def dependencies(tree: Path) -> list[str]:
    """The [project] dependencies `tree`'s pyproject.toml declares."""
    with open(tree / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f).get("project", {}).get("dependencies", []))


def dependency_mismatches(tree: Path) -> list[str]:
    """The declared dependencies of `tree` this interpreter's installed packages do not satisfy
    (missing, or a version outside the range; extras are not checked). Empty: they match."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging comes with pip/setuptools, but is not a dependency of ours
        return [] if dependencies(tree) == dependencies(REPO) else ["(declared dependencies differ; not checked)"]
    found = []
    for text in dependencies(tree):
        req = Requirement(text)
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{text}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            found.append(f"{text}: {version} installed")
    return found


def side_env(tree: Path) -> dict[str, str]:
    """This process's environment for a program that must import `tracker` and `harvester` from
    `tree` only: PYTHONPATH is `tree`, and no REAPER_* setting leaks into its configuration."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("REAPER_") and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")
    }
    env["PYTHONPATH"] = str(tree)
    return env


def pair_ratios(
    new_runs: Sequence[dict[str, Any]], old_runs: Sequence[dict[str, Any]], name: str, required: bool = False
) -> list[float] | None:
    """`name`'s ratios new/old pair by pair, rounded to 3 places; None when a run left it out or gave
    it as null (not measured on this machine, e.g. a database elsewhere) or a baseline run's is 0 (a
    CPU figure below the clock's resolution in a short run): no ratio is better than a made-up one.
    A `required` figure (the compared one) must be there and positive: KeyError or ValueError."""
    olds = [o.get(name) for o in old_runs]
    news = [n.get(name) for n in new_runs]
    if required:
        if any(v is None for v in (*olds, *news)):
            raise KeyError(f"{name} is missing from a run's last line")
        if any(v <= 0 for v in olds):
            raise ValueError(f"{name} of a baseline run is {min(olds)}: no ratio can be taken")
    elif any(v is None for v in (*olds, *news)) or any(v == 0 for v in olds):
        return None
    return [round(n / o, 3) for n, o in zip(news, olds)]


def compare(
    ref: str,
    script: Path,
    args: Sequence[str],
    figure: str,
    pairs: int,
    *,
    log: Callable[[str], None],
    python: str = sys.executable,
    after_pair: Callable[[int], Any] | None = None,
    more: Sequence[str] = (),
) -> dict[str, Any]:
    """Run `script` (a file of the working tree that imports nothing from bench/: under REF's path,
    `bench` would be REF's) with `args`, once under the working tree's code and once under REF's
    checkout per pair, alternating which goes first (bench.pairs.alternate), each run in a process of
    its own (`python -P`, the tree alone on PYTHONPATH). Every run's last line is a JSON object with
    `figure` and `code` (the folder its code came from, checked). `python`: the interpreter for REF.

    Returns the ref, its commit and checkout, the interpreter, `dependency_mismatches` (None when
    REF has an interpreter of its own), what `alternate` returns (the order, each pair's figures and
    ratio new/old, their summaries, the load averages), every run's whole object (`runs`) and
    `figures`: for `figure` and each of `more` (other keys of the runs' last lines), the ratios
    new/old pair by pair (`ratios`), their summary (`ratio`) and each side's (`new`, `old`); None
    for one of `more` that a run left out or gave as null."""
    started_load = load_average()
    tree = checkout(ref, log=log)
    sha = (tree / MARK).read_text().strip()
    mismatches = dependency_mismatches(tree) if python == sys.executable else None
    if mismatches:
        log(
            f"baseline {ref}: this interpreter does not satisfy its declared dependencies ({'; '.join(mismatches)}); "
            "running it anyway: if it fails, give it an interpreter of its own with --baseline-python"
        )

    def side(name: str, root: Path, interpreter: str) -> Command:
        argv = [interpreter, "-P", str(script), *args]
        return Command(name, argv, figure, env=side_env(root), cwd=root, expect={"code": str(root.resolve())})

    new, old = side("new", REPO, sys.executable), side("old", tree, python)
    log(f"baseline {ref} ({sha[:12]}) at {tree}: {pairs} pairs, load average {started_load}")
    cmp = alternate(new, old, pairs, after_pair=after_pair, log=log)
    cmp["load_average_at_start"] = started_load
    figures: dict[str, Any] = {}
    for name in (figure, *more):
        ratios = pair_ratios(new.runs, old.runs, name, required=name == figure)
        if ratios is None:
            figures[name] = None
            log(f"{name}: not measured in every run, or zero in the baseline's, no ratio")
            continue
        figures[name] = {
            "ratios": ratios,
            "ratio": summary(ratios),
            "new": summary([r[name] for r in new.runs]),
            "old": summary([r[name] for r in old.runs]),
        }
        log(f"{name}: ratios new/old {ratios}, median {figures[name]['ratio']['median']}")
    return {
        "ref": ref,
        "commit": sha,
        "checkout": str(tree),
        "python": python,
        "dependency_mismatches": mismatches,
        **cmp,
        "runs": {"new": new.runs, "old": old.runs},
        "figures": figures,
    }
