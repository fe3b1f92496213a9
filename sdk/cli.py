"""The `corral` command line: run the daemon, manage sandboxes, run commands, copy files."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _serve(args: argparse.Namespace) -> int:
    from corral.daemon.config import ConfigError, load_config
    from corral.daemon.server import DaemonAlreadyRunning, main

    try:
        config = load_config(
            args.config, socket=args.socket, state_dir=args.state_dir, tcp_listen=args.tcp,
            token_file=args.token_file, metrics_listen=args.metrics,
        )
        main(config)
    except (ConfigError, DaemonAlreadyRunning) as err:
        print(f"corral serve: {err}", file=sys.stderr)
        return 2
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from corral.daemon.config import ConfigError, load_config
    from corral.daemon.doctor import report

    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"corral doctor: {err}", file=sys.stderr)
        return 2
    print(report(config))
    return 0


def _client(args: argparse.Namespace):
    from corral.sdk import Client

    return Client(args.address, token=os.environ.get("CORRAL_TOKEN"))


def _sandbox_create(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sandbox = client.create_sandbox(
            image=args.image, backend=args.backend, network=args.network,
            memory_bytes=args.memory, pids=args.pids, cpu_millicores=args.cpu,
            labels=dict(kv.split("=", 1) for kv in args.label),
        )
        print(sandbox.id)
    return 0


def _sandbox_ls(args: argparse.Namespace) -> int:
    with _client(args) as client:
        sandboxes = client.list_sandboxes()
        if args.json:
            print(json.dumps([{"id": s.id, "backend": s.backend, "image": s.image, "state": s.state,
                               "labels": s.labels} for s in sandboxes], indent=2))
            return 0
        print(f"{'ID':<18} {'BACKEND':<12} {'STATE':<10} IMAGE")
        for s in sandboxes:
            print(f"{s.id:<18} {s.backend:<12} {s.state:<10} {s.image}")
    return 0


def _sandbox_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for sandbox_id in args.ids:
            client.get_sandbox(sandbox_id).destroy()
    return 0


def _exec(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("corral exec: give a command after --", file=sys.stderr)
        return 2
    with _client(args) as client:
        sandbox = client.get_sandbox(args.id)
        result = sandbox.exec(command if len(command) > 1 or not args.shell else command[0],
                              timeout=args.timeout, cwd=args.cwd)
        sys.stdout.buffer.write(result.stdout)
        sys.stderr.buffer.write(result.stderr)
        if result.timed_out:
            print(f"corral exec: timed out after {args.timeout}s", file=sys.stderr)
        if result.truncated:
            print("corral exec: output was truncated", file=sys.stderr)
    return result.exit_code


def _cp(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corral", description=__doc__)
    parser.add_argument("--address", default=None,
                        help="daemon address: unix:///path or host:port (default: $CORRAL_SOCKET or /run/corral/corral.sock)")
    sub = parser.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run the node daemon")
    serve.add_argument("--config", help="TOML configuration (default: $CORRAL_CONFIG)")
    serve.add_argument("--socket", help="Unix socket path")
    serve.add_argument("--state-dir", help="state directory")
    serve.add_argument("--tcp", help="also listen on HOST:PORT (needs a token)")
    serve.add_argument("--token-file", help="file holding the TCP bearer token")
    serve.add_argument("--metrics", help="serve Prometheus metrics on HOST:PORT")
    serve.set_defaults(func=_serve)

    doctor = sub.add_parser("doctor", help="explain which backends, isolation and limits work here")
    doctor.add_argument("--config")
    doctor.set_defaults(func=_doctor)

    sandbox = sub.add_parser("sandbox", help="create, list and remove sandboxes")
    ssub = sandbox.add_subparsers(dest="sandbox_cmd", required=True)
    create = ssub.add_parser("create", help="create a sandbox and print its id")
    create.add_argument("--image", default="host")
    create.add_argument("--backend", default=None, choices=["local", "docker", "singularity"])
    create.add_argument("--network", action="store_true", help="allow network access")
    create.add_argument("--memory", type=int, default=None, help="memory limit in bytes")
    create.add_argument("--pids", type=int, default=None)
    create.add_argument("--cpu", type=int, default=None, help="CPU limit in millicores")
    create.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    create.set_defaults(func=_sandbox_create)
    ls = ssub.add_parser("ls", help="list sandboxes")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_sandbox_ls)
    rm = ssub.add_parser("rm", help="destroy sandboxes")
    rm.add_argument("ids", nargs="+")
    rm.set_defaults(func=_sandbox_rm)

    exec_ = sub.add_parser("exec", help="run a command in a sandbox: corral exec ID -- CMD ...")
    exec_.add_argument("id")
    exec_.add_argument("--timeout", type=float, default=600)
    exec_.add_argument("--cwd", default=None)
    exec_.add_argument("--shell", action="store_true", help="run a single argument with the sandbox's shell")
    exec_.add_argument("command", nargs=argparse.REMAINDER)
    exec_.set_defaults(func=_exec)

    cp = sub.add_parser("cp", help="copy files: corral cp LOCAL ID:DIR | corral cp ID:PATH LOCAL_DIR")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=_cp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from corral.sdk.errors import CorralError

    try:
        return args.func(args)
    except CorralError as err:
        print(f"corral {args.cmd}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
