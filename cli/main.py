"""The `corral` command line: run the daemon, manage sandboxes, run commands, copy files, open a
terminal in a sandbox, run rollouts of tasks (`corral run`)."""

from __future__ import annotations

import argparse
import sys

from corral.cli import daemon_commands, run, sandbox_commands, swerex_command
from corral.sdk.errors import CorralError, Unavailable

UNAVAILABLE_HINT = (
    "if no daemon runs there, start one (`corral serve`, or `systemctl start corral` where it is installed "
    "as a service), or point --address or $CORRAL_ADDRESS at the one you mean"
)


ADDRESS_HELP = (
    "daemon address: unix:///path, /path or host:port "
    "(default: $CORRAL_ADDRESS, else $CORRAL_SOCKET, else /run/corral/corral.sock)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corral", description=__doc__)
    parser.add_argument("--address", default=None, help=ADDRESS_HELP)
    sub = parser.add_subparsers(dest="cmd", required=True)
    daemon_commands.add_parsers(sub)
    sandbox_commands.add_parsers(sub)
    run.add_parsers(sub)
    swerex_command.add_parsers(sub)
    # --address also after the subcommand (`corral run TASKS --address ...`); SUPPRESS keeps the
    # value given before it when it is not repeated there.
    for name, subparser in sub.choices.items():
        if name != "serve":
            _add_address(subparser)
    return parser


def _add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=argparse.SUPPRESS, help=ADDRESS_HELP)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                _add_address(subparser)


def main(argv: list[str] | None = None) -> int:
    argv, command = sandbox_commands.split_exec_command(sys.argv[1:] if argv is None else list(argv))
    args = build_parser().parse_args(argv)
    if command is not None:
        args.command = [*args.command, "--", *command] if args.command else command
    try:
        return args.func(args)
    except Unavailable as err:
        # (A socket this user may not reach has a hint of its own: whom to ask, not "start one".)
        hint = f"\nhint: {UNAVAILABLE_HINT}" if err.hint is None else ""
        print(f"corral {args.cmd}: {err}{hint}", file=sys.stderr)
        return 1
    except (CorralError, OSError) as err:
        print(f"corral {args.cmd}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
