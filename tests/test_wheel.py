"""The wheel users install holds every file the packages read at run time: a test run from the
checkout finds the console's templates, the SQL and the OpenAPI document beside the code even when
the distribution would leave them out."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _source_files(config: dict) -> set[str]:
    """Every file of every listed package, as its path inside the wheel."""
    setuptools = config["tool"]["setuptools"]
    folders = setuptools.get("package-dir", {})
    wanted = set()
    for package in setuptools["packages"]:
        source = ROOT / folders.get(package, package.replace(".", "/"))
        for file in source.iterdir():
            if file.is_file() and file.suffix != ".pyc":
                wanted.add(f"{package.replace('.', '/')}/{file.name}")
    return wanted


def test_the_wheel_ships_every_module_and_data_file_without_warnings(tmp_path):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, source / name)
    for folder in ("tracker", "harvester", "sql"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    # setuptools warns of data folders it may stop shipping ("Package would be ignored")
    assert "would be ignored" not in output, output[-4000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files(config) - shipped)
    assert missing == [], f"left out of the wheel: {missing}"
    assert any(name.startswith("harvester/services/console/templates/") for name in shipped)
