#!/usr/bin/env python3
"""Runs mypy over the whole tree with the `corral.*` import names resolved to the short folders.

pyproject.toml maps `corral.daemon` to daemon/, `corral.sdk` to sdk/ and so on; a static checker
cannot follow that mapping (the editable install resolves it with an import hook), so this script
mirrors it, fresh from pyproject.toml on every run, as build/typecheck/corral/<name>/... with a
symlink per source file (mypy does not walk symlinked folders), checks that tree together with the
rest of the tree (tests, scripts, bench, examples), and prints the findings under the real paths.

    python scripts/typecheck.py [extra mypy arguments]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKS = ROOT / "build" / "typecheck"
# Checked as files: everything else with Python in it (the example tasks' repositories excepted:
# their bugs are the tasks).
FILE_ROOTS = ["tests", "scripts", "bench", "examples"]


def package_dirs() -> dict[str, str]:
    """{"corral.daemon": "daemon", ...} from pyproject.toml."""
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["tool"]["setuptools"]["package-dir"]


def link_tree(mapping: dict[str, str]) -> dict[str, str]:
    """Makes the mirror; returns {mirror path prefix: real path prefix} for the output."""
    shutil.rmtree(LINKS, ignore_errors=True)
    prefixes = {}
    for name, folder in mapping.items():
        mirror = LINKS.joinpath(*name.split("."))
        for source in sorted((ROOT / folder).rglob("*.py*")):
            if source.suffix in (".py", ".pyi") and "__pycache__" not in source.parts:
                link = mirror / source.relative_to(ROOT / folder)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(source)
        prefixes[f"{mirror.relative_to(ROOT)}/"] = f"{folder}/"
    return prefixes


def main() -> int:
    prefixes = link_tree(package_dirs())
    files = [str(LINKS.relative_to(ROOT)), *(root for root in FILE_ROOTS if (ROOT / root).is_dir())]
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", *files, *sys.argv[1:]], cwd=ROOT, capture_output=True, text=True
    )
    output = checked.stdout
    # Longest prefix first: corral/trainer_adapters/sao/ before corral/trainer_adapters/.
    for mirror, real in sorted(prefixes.items(), key=lambda item: -len(item[0])):
        output = output.replace(mirror, real)
    sys.stdout.write(output)
    sys.stderr.write(checked.stderr)
    return checked.returncode


if __name__ == "__main__":
    sys.exit(main())
