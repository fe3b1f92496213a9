"""The `corral` command line: run the daemon, manage sandboxes, run commands, copy files, open a
terminal in a sandbox, run rollouts of tasks (`corral run`)."""

from __future__ import annotations

import argparse
import sys

from corral.cli import daemon_commands, run, sandbox_commands
from corral.sdk.errors import CorralError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corral", description=__doc__)
    parser.add_argument(
        "--address",
        default=None,
        help="daemon address: unix:///path or host:port (default: $CORRAL_SOCKET or /run/corral/corral.sock)",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    daemon_commands.add_parsers(sub)
    sandbox_commands.add_parsers(sub)
    run.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CorralError as err:
        print(f"corral {args.cmd}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
