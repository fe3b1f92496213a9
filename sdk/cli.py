"""The `corral` command line: run the daemon, manage sandboxes, run commands, copy files, open a
terminal in a sandbox, run rollouts of tasks (`corral run`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator


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


# Sent when piped stdin ends: what Ctrl-D at an empty prompt sends, so the shell exits once it has
# run everything before it, as `bash < file` would (ending the stream instead would kill it at
# once). It is resent until the shell exits: a Ctrl-D that reaches the terminal while a command
# runs, or before the shell's line editor has taken the terminal over, ends that command's input
# or is dropped by the terminal, not seen by the shell.
_END_OF_INPUT = b"\x04"
_END_OF_INPUT_INTERVAL_S = 0.25
_READ_SIZE = 4096


def _shell(args: argparse.Namespace) -> int:
    """An interactive terminal in a sandbox over ShellService.Attach.

    The local terminal goes into raw mode, so every key (Ctrl-C included) reaches the shell inside;
    window size changes follow. With stdin not a terminal (piped input), the bytes are sent as
    they are and the command exits with the shell's exit code once the shell has read them all.
    """
    import queue
    import signal
    import threading

    from corral.sdk import _core

    stdin_fd = sys.stdin.fileno()
    interactive = os.isatty(stdin_fd)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    rows, cols = _window_size()
    requests.put(_core.build_attach_start(args.id, rows=rows, cols=cols, term=os.environ.get("TERM"),
                                          program=args.program))

    def outgoing():
        # Runs on grpc's sending thread; None ends the stream.
        while (message := requests.get()) is not None:
            yield message

    finished = threading.Event()

    def forward_stdin() -> None:
        while True:
            try:
                data = os.read(stdin_fd, _READ_SIZE)
            except OSError:
                data = b""
            if not data:
                break
            requests.put(_core.build_attach_input(data))
        if interactive:
            # The local terminal hung up; the SIGHUP that comes with it ends this command (see
            # _raw_terminal), and there is nothing more to send.
            requests.put(None)
            return
        while not finished.is_set():
            requests.put(_core.build_attach_input(_END_OF_INPUT))
            finished.wait(_END_OF_INPUT_INTERVAL_S)

    def on_resize(_signum: int, _frame: object) -> None:
        requests.put(_core.build_attach_resize(*_window_size()))

    exit_code: int | None = None
    sys.stdout.flush()
    with _client(args) as client, _raw_terminal(stdin_fd if interactive else None):
        transport = client._transport
        responses = transport.interactive_stream(transport.shell_service.Attach, outgoing())
        previous_winch = signal.signal(signal.SIGWINCH, on_resize)
        try:
            # A daemon thread: a read blocked on the local terminal must not keep the process alive.
            threading.Thread(target=forward_stdin, name="corral-shell-stdin", daemon=True).start()
            for response in responses:
                item = _core.attach_output_or_exit(response)
                if isinstance(item, int):
                    exit_code = item
                    break
                _write_all(sys.stdout.fileno(), item)
        except KeyboardInterrupt:
            # Only without a local terminal (in raw mode Ctrl-C is a byte for the shell inside):
            # ending the stream kills the shell.
            return 130
        finally:
            finished.set()
            signal.signal(signal.SIGWINCH, previous_winch)
            requests.put(None)
            responses.close()
    if exit_code is None:
        print("corral shell: the terminal ended without an exit status", file=sys.stderr)
        return 1
    return exit_code


def _window_size() -> tuple[int, int]:
    """Rows and columns of the local terminal (80x24 when there is none)."""
    import shutil

    for fd in (1, 0, 2):
        try:
            size = os.get_terminal_size(fd)
        except OSError:
            continue
        if size.lines > 0 and size.columns > 0:
            return size.lines, size.columns
    size = shutil.get_terminal_size()
    return max(1, size.lines), max(1, size.columns)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextlib.contextmanager
def _raw_terminal(fd: int | None) -> Iterator[None]:
    """Puts a terminal in raw mode for the duration of a `with` block and restores it on the way
    out, whatever ends the block (SIGTERM and SIGHUP included). Does nothing for fd None."""
    if fd is None:
        yield
        return
    import signal
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    # Raising SystemExit unwinds through the `finally` below, which restores the terminal.
    previous = {signum: signal.signal(signum, _exit_on_signal) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


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
    create.add_argument("--image", default=None, help="default: the backend's default image on the node")
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

    shell = sub.add_parser("shell", help="an interactive terminal in a sandbox: corral shell ID")
    shell.add_argument("id")
    shell.add_argument("--program", default=None, help="shell program inside the sandbox (default: bash, else sh)")
    shell.set_defaults(func=_shell)

    cp = sub.add_parser("cp", help="copy files: corral cp LOCAL ID:DIR | corral cp ID:PATH LOCAL_DIR")
    cp.add_argument("src")
    cp.add_argument("dst")
    cp.set_defaults(func=_cp)

    from corral.sdk.run_command import add_run_parser

    add_run_parser(sub)
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
