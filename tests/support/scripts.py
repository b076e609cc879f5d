"""A script of the repository (deploy/, tests/clients/, a file from git) loaded as a module by its
path: such scripts are run directly and are not in any package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path, name: str, *, register: bool = False) -> ModuleType:
    """The module in `path`, named `name`. `register`: also in sys.modules under that name (what
    dataclasses and pickling look their module up in)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
