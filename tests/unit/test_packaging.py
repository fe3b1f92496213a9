"""The wheel holds every package in the tree: each folder with Python files under a mapped folder
of pyproject.toml is listed in [tool.setuptools] packages (a new subpackage cannot be silently
left out), and nothing listed is missing."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for source in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in source.parts:
                continue
            relative = source.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *relative.parts]))
    assert found - listed == set(), "folders with Python files missing from [tool.setuptools] packages"
    assert listed - found == set(), "packages listed in pyproject.toml without a folder"
