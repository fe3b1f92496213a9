"""`corral sandbox create|ls|rm`, `corral exec`, `corral cp` and `corral shell`: SDK clients of a
running daemon."""

from __future__ import annotations

import argparse
import json
import os
import sys

from corral.sdk import Client
from corral.sdk.enums import BACKEND_NAMES
from corral.sdk.terminal import TerminalEnded, attach_terminal


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sandbox = sub.add_parser("sandbox", help="create, list and remove sandboxes")
    ssub = sandbox.add_subparsers(dest="sandbox_cmd", required=True)
    create = ssub.add_parser("create", help="create a sandbox and print its id")
    create.add_argument("--image", default=None, help="default: the backend's default image on the node")
    create.add_argument("--backend", default=None, choices=BACKEND_NAMES)
    create.add_argument("--network", action="store_true", help="allow network access")
    create.add_argument("--memory", type=int, default=None, help="memory limit in bytes")
    create.add_argument("--pids", type=int, default=None)
    create.add_argument("--cpu", type=int, default=None, help="CPU limit in millicores")
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    create.set_defaults(func=sandbox_create)
    ls = ssub.add_parser("ls", help="list sandboxes")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=sandbox_ls)
    rm = ssub.add_parser("rm", help="destroy sandboxes")
    rm.add_argument("ids", nargs="+")
    rm.set_defaults(func=sandbox_rm)

    exec_ = sub.add_parser("exec", help="run a command in a sandbox: corral exec ID -- CMD ...")
    exec_.add_argument("id")
    exec_.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds before the command's process tree is killed (default: the daemon's exec.default_timeout_s, "
        "600 unless configured)",
    )
    exec_.add_argument("--cwd", default=None)
    exec_.add_argument("--shell", action="store_true", help="run a single argument with the sandbox's shell")
    exec_.add_argument("command", nargs=argparse.REMAINDER)
    exec_.set_defaults(func=exec_command)

    shell = sub.add_parser("shell", help="an interactive terminal in a sandbox: corral shell ID")
    shell.add_argument("id")
    shell.add_argument("--program", default=None, help="shell program inside the sandbox (default: bash, else sh)")
    shell.set_defaults(func=shell_command)

    cp = sub.add_parser("cp", help="copy files: corral cp LOCAL ID:DIR | corral cp ID:PATH LOCAL_DIR")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=cp_command)


def _client(args: argparse.Namespace) -> Client:
    return Client(args.address, token=os.environ.get("CORRAL_TOKEN"))


def sandbox_create(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sandbox = client.create_sandbox(
            image=args.image,
            backend=args.backend,
            network=args.network,
            memory_bytes=args.memory,
            pids=args.pids,
            cpu_millicores=args.cpu,
            labels=dict(kv.split("=", 1) for kv in args.label),
        )
        print(sandbox.id)
    return 0


def sandbox_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sandboxes = client.list_sandboxes()
        if args.json:
            print(
                json.dumps(
                    [
                        {"id": s.id, "backend": s.backend, "image": s.image, "state": s.state, "labels": s.labels}
                        for s in sandboxes
                    ],
                    indent=2,
                )
            )
            return 0
        print(f"{'ID':<18} {'BACKEND':<12} {'STATE':<10} IMAGE")
        for s in sandboxes:
            print(f"{s.id:<18} {s.backend:<12} {s.state:<10} {s.image}")
    return 0


def sandbox_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for sandbox_id in args.ids:
            client.get_sandbox(sandbox_id).destroy()
    return 0


def exec_command(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("corral exec: give a command after --", file=sys.stderr)
        return 2
    with _client(args) as client:
        sandbox = client.get_sandbox(args.id)
        result = sandbox.exec(
            command if len(command) > 1 or not args.shell else command[0], timeout=args.timeout, cwd=args.cwd
        )
        sys.stdout.buffer.write(result.stdout)
        sys.stderr.buffer.write(result.stderr)
        if result.timed_out:
            print(f"corral exec: timed out after {result.duration_ms / 1000:g}s", file=sys.stderr)
        if result.truncated:
            print("corral exec: output was truncated", file=sys.stderr)
    return result.exit_code


def cp_command(args: argparse.Namespace) -> int:
    """`cp ID:REMOTE LOCAL_DIR` downloads; `cp LOCAL ID:REMOTE_DIR` uploads."""
    src, dst = args.src, args.dst
    with _client(args) as client:
        if ":" in src and not os.path.exists(src):
            sandbox_id, remote = src.split(":", 1)
            client.get_sandbox(sandbox_id).download(remote, dst)
        elif ":" in dst:
            sandbox_id, remote = dst.split(":", 1)
            client.get_sandbox(sandbox_id).upload(src, remote)
        else:
            print("corral cp: one side must be ID:PATH", file=sys.stderr)
            return 2
    return 0


def shell_command(args: argparse.Namespace) -> int:
    """An interactive terminal in a sandbox (see corral.sdk.terminal)."""
    with _client(args) as client:
        try:
            return attach_terminal(client, args.id, program=args.program)
        except TerminalEnded as err:
            print(f"corral shell: {err}", file=sys.stderr)
            return 1
