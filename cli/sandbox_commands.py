"""`corral sandbox create|ls|rm`, `corral exec`, `corral cp` and `corral shell`: SDK clients of a
running daemon."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from corral.sdk import Client, Mount
from corral.sdk.enums import BACKEND_NAMES
from corral.sdk.terminal import TerminalEnded, attach_terminal


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sandbox = sub.add_parser("sandbox", help="create, list and remove sandboxes")
    ssub = sandbox.add_subparsers(dest="sandbox_cmd", required=True)
    create = ssub.add_parser("create", help="create a sandbox and print its id")
    create.add_argument("--image", default=None, help="default: the backend's default image on the node")
    create.add_argument("--backend", default=None, choices=BACKEND_NAMES)
    create.add_argument("--network", action="store_true", help="allow network access")
    create.add_argument(
        "--memory",
        type=memory_size,
        default=None,
        metavar="SIZE",
        help="memory limit: bytes, or with a binary unit: 512M, 1G, 1.5GiB (K, M, G, T; "
        "KB, MB, ... are read as KiB, MiB, ..., as docker does)",
    )
    create.add_argument("--pids", type=int, default=None)
    create.add_argument("--cpu", type=int, default=None, help="CPU limit in millicores")
    create.add_argument(
        "--disk", type=memory_size, default=None, metavar="SIZE", help="size of its writable space, e.g. 2G"
    )
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    create.add_argument(
        "--user",
        default=None,
        help="who its commands, shells and kernels run as by default: a user name of the image, a uid or "
        "UID:GID (default: the image's own user)",
    )
    create.add_argument(
        "--mount",
        action="append",
        type=bind_mount,
        default=[],
        metavar="HOST:SANDBOX[:rw]",
        help="show a host path inside the sandbox, read-only unless :rw (only under the daemon's "
        "sandbox.bind_roots); repeatable",
    )
    create.set_defaults(func=sandbox_create)
    ls = ssub.add_parser("ls", help="list sandboxes")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=sandbox_ls)
    rm = ssub.add_parser("rm", help="destroy sandboxes")
    rm.add_argument("ids", nargs="+")
    rm.set_defaults(func=sandbox_rm)

    exec_ = sub.add_parser(
        "exec",
        help="run a command in a sandbox: corral exec [OPTIONS] ID -- CMD ...",
        usage="corral exec [-h] [-i] [--timeout SECONDS] [--cwd DIR] [--user USER] [--shell] ID -- COMMAND [ARG ...]",
        description="Runs a command in a sandbox and exits with its exit status. Options go before the --, "
        "before or after ID; everything after the -- is the command. Its stdin is at EOF unless -i is given.",
    )
    exec_.add_argument("id")
    exec_.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds before the command's process tree is killed (default: the daemon's exec.default_timeout_s, "
        "600 unless configured)",
    )
    exec_.add_argument(
        "--cwd", default=None, metavar="DIR", help="working directory: absolute, or relative to the workdir"
    )
    exec_.add_argument(
        "--user", default=None, help="run as this user: a name, a uid or UID:GID (default: the sandbox's user)"
    )
    exec_.add_argument("--shell", action="store_true", help="run a single argument with the sandbox's shell")
    exec_.add_argument(
        "-i",
        "--stdin",
        action="store_true",
        help="forward this process's stdin to the command (read to its end before the command starts)",
    )
    # Filled by main() with what follows the first `--` (see split_exec_command); words before the
    # `--` that are not options start the command too (`corral exec ID pwd`).
    exec_.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    exec_.set_defaults(func=exec_command)

    fork = sub.add_parser(
        "fork",
        help="fork a sandbox: new sandboxes whose files start as a copy-on-write copy of its own; prints their ids",
    )
    fork.add_argument("id", nargs="?", default="", help="the sandbox to fork (or --snapshot)")
    fork.add_argument("--snapshot", default="", metavar="NAME", help="make the children from a named snapshot")
    fork.add_argument("-n", "--count", type=int, default=1, help="how many children, 1..64 (default 1)")
    fork.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="added to the parent's")
    fork.set_defaults(func=fork_command)
    snapshot = sub.add_parser(
        "snapshot", help="named snapshots of sandboxes' files, which `corral fork --snapshot` uses"
    )
    snapsub = snapshot.add_subparsers(dest="snapshot_cmd", required=True)
    take = snapsub.add_parser(
        "take", help="keep a copy of a sandbox's files under a name: corral snapshot take ID NAME"
    )
    take.add_argument("id")
    take.add_argument("name")
    take.set_defaults(func=snapshot_take)
    snapsub.add_parser("ls", help="list named snapshots").set_defaults(func=snapshot_ls)
    drop = snapsub.add_parser("rm", help="delete named snapshots")
    drop.add_argument("names", nargs="+")
    drop.set_defaults(func=snapshot_rm)
    shell = sub.add_parser("shell", help="an interactive terminal in a sandbox: corral shell ID")
    shell.add_argument("id")
    shell.add_argument("--program", default=None, help="shell program inside the sandbox (default: bash, else sh)")
    shell.add_argument(
        "--user", default=None, help="run as this user: a name, a uid or UID:GID (default: the sandbox's user)"
    )
    shell.set_defaults(func=shell_command)

    cp = sub.add_parser("cp", help="copy files: corral cp LOCAL ID:DIR | corral cp ID:PATH LOCAL_DIR")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=cp_command)


def _client(args: argparse.Namespace) -> Client:
    return Client(args.address, token=os.environ.get("CORRAL_TOKEN"))


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)
_UNIT_SHIFT = {"k": 10, "m": 20, "g": 30, "t": 40}


def memory_size(text: str) -> int:
    """Bytes from "1073741824", "512M", "1G", "1.5GiB", "2gb" (every unit binary, as docker reads them)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: give bytes, or a number with K, M, G or T (1G, 512M)")
    number, unit = match.groups()
    size = int(float(number) * (1 << _UNIT_SHIFT[unit.lower()])) if unit else int(float(number))
    if size <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be positive")
    return size


def bind_mount(text: str) -> Mount:
    """A Mount from "HOST:SANDBOX", "HOST:SANDBOX:ro" or "HOST:SANDBOX:rw" (read-only by default)."""
    parts = text.split(":")
    writable = False
    if len(parts) == 3 and parts[2] in ("ro", "rw"):
        writable = parts.pop() == "rw"
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"invalid mount {text!r}: give HOST:SANDBOX, optionally with :ro or :rw")
    return Mount(parts[0], parts[1], writable)


def split_exec_command(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """For `corral [...] exec [...] -- COMMAND ...`: (the arguments before the first `--`, the
    command after it), so that argparse never sees the command's own options; (argv, None) for
    other subcommands or without `--`."""
    if "--" not in argv:
        return argv, None
    split = argv.index("--")
    head = argv[:split]
    words = iter(head)
    for word in words:
        if word == "--address":
            next(words, None)
        elif not word.startswith("-"):
            return (head, argv[split + 1 :]) if word == "exec" else (argv, None)
    return argv, None


def sandbox_create(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sandbox = client.create_sandbox(
            image=args.image,
            backend=args.backend,
            network=args.network,
            memory_bytes=args.memory,
            pids=args.pids,
            cpu_millicores=args.cpu,
            disk_bytes=args.disk,
            labels=dict(kv.split("=", 1) for kv in args.label),
            user=args.user,
            mounts=args.mount,
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
                        {
                            "id": s.id,
                            "backend": s.backend,
                            "image": s.image,
                            "state": s.state,
                            "labels": s.labels,
                            "host_id_first": s.host_id_first,
                            "host_id_count": s.host_id_count,
                        }
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


def fork_command(args: argparse.Namespace) -> int:
    if bool(args.id) == bool(args.snapshot):
        print("corral fork: give a sandbox id or --snapshot NAME", file=sys.stderr)
        return 2
    labels = dict(kv.split("=", 1) for kv in args.label)
    with _client(args) as client:
        if args.snapshot:
            children = client.fork_snapshot(args.snapshot, args.count, labels=labels)
        else:
            children = client.get_sandbox(args.id).fork(args.count, labels=labels)
        for child in children:
            print(child.id)
    return 0


def snapshot_take(args: argparse.Namespace) -> int:
    with _client(args) as client:
        taken = client.get_sandbox(args.id).snapshot(args.name)
        print(f"{taken.name} {taken.size_bytes}")
    return 0


def snapshot_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(f"{'NAME':<24} {'SANDBOX':<18} {'BYTES':>12} IMAGE")
        for s in client.list_snapshots():
            print(f"{s.name:<24} {s.sandbox_id:<18} {s.size_bytes:>12} {s.image}")
    return 0


def snapshot_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for name in args.names:
            client.delete_snapshot(name)
    return 0


def exec_command(args: argparse.Namespace) -> int:
    command = args.command
    if not command:
        print("corral exec: give a command after --", file=sys.stderr)
        return 2
    stdin = sys.stdin.buffer.read() if args.stdin else None
    with _client(args) as client:
        sandbox = client.get_sandbox(args.id)
        result = sandbox.exec(
            command if len(command) > 1 or not args.shell else command[0],
            stdin=stdin,
            timeout=args.timeout,
            cwd=args.cwd,
            user=args.user,
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
    download = ":" in src and not os.path.exists(src)
    if not download and ":" not in dst:
        print("corral cp: one side must be ID:PATH", file=sys.stderr)
        return 2
    if not download and not os.path.lexists(src):
        print(f"corral cp: {src}: no such file or directory", file=sys.stderr)
        return 1
    with _client(args) as client:
        if download:
            sandbox_id, remote = src.split(":", 1)
            client.get_sandbox(sandbox_id).download(remote, dst)
        else:
            sandbox_id, remote = dst.split(":", 1)
            client.get_sandbox(sandbox_id).upload(src, remote)
    return 0


def shell_command(args: argparse.Namespace) -> int:
    """An interactive terminal in a sandbox (see corral.sdk.terminal)."""
    with _client(args) as client:
        try:
            return attach_terminal(client, args.id, program=args.program, user=args.user)
        except TerminalEnded as err:
            print(f"corral shell: {err}", file=sys.stderr)
            return 1
