"""The version is written once, in pyproject.toml; the package and ``stablewatch --version`` read it
from the installed distribution's metadata."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import stablewatch

ROOT = Path(__file__).resolve().parent.parent


def test_the_version_is_written_once_in_pyproject() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = config["project"]["version"]
    assert stablewatch.__version__ == importlib.metadata.version("stablewatch") == version
    folders = set(config["tool"]["setuptools"]["package-dir"].values())
    again = [
        str(path.relative_to(ROOT))
        for folder in folders
        for path in (ROOT / folder).rglob("*.py")
        if f'"{version}"' in path.read_text() or f"'{version}'" in path.read_text()
    ]
    assert not again, f"the version {version} is written again in {again}"
