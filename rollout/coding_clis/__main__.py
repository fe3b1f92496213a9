"""python -m corral.rollout.coding_clis install [--prefix DIR] [NAME ...]: installs the registered
coding CLIs (all, or those named) from npm at their pinned versions (install.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from corral.rollout.coding_clis import coding_cli, names
from corral.rollout.coding_clis.install import DEFAULT_PREFIX, PREFIX_VARIABLE, InstallError, default_prefix, install


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral.rollout.coding_clis")
    commands = parser.add_subparsers(dest="command", required=True)
    installing = commands.add_parser("install", help="install the coding CLIs from npm at their pinned versions")
    installing.add_argument(
        "--prefix",
        default=default_prefix(),
        help=f"npm prefix to install into (default: ${PREFIX_VARIABLE}, else {DEFAULT_PREFIX})",
    )
    installing.add_argument(
        "names", nargs="*", metavar="NAME", help=f"CLIs to install (default: all: {', '.join(names())})"
    )
    args = parser.parse_args(argv)
    try:
        clis = [coding_cli(name) for name in args.names or names()]
    except ValueError as error:
        parser.error(str(error))
    try:
        install(args.prefix, clis)
    except InstallError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
