"""An interactive terminal in a sandbox over ShellService.Attach, bridged to this process's own
terminal: what `corral shell ID` runs.

The local terminal goes into raw mode, so every key (Ctrl-C included) reaches the shell inside;
window size changes follow. With stdin not a terminal (piped input), the bytes are sent as they
are and the call returns the shell's exit code once the shell has read them all.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import sys
import threading
from collections.abc import Iterator

from corral.sdk import _core
from corral.sdk.sync_client import Client
from corral.v1 import shell_pb2

# Sent when piped stdin ends: what Ctrl-D at an empty prompt sends, so the shell exits once it has
# run everything before it, as `bash < file` would (ending the stream instead would kill it at
# once). It is resent until the shell exits: a Ctrl-D that reaches the terminal while a command
# runs, or before the shell's line editor has taken the terminal over, ends that command's input
# or is dropped by the terminal, not seen by the shell.
_END_OF_INPUT = b"\x04"
_END_OF_INPUT_INTERVAL_S = 0.25
_READ_SIZE = 4096


class TerminalEnded(Exception):
    """The terminal stream ended without the shell's exit status."""


def attach_terminal(client: Client, sandbox_id: str, *, program: str | None = None, user: str | None = None) -> int:
    """Connects this process's stdin/stdout to a new shell in the sandbox until the shell exits,
    and returns its exit code (130 after a KeyboardInterrupt without a local terminal).
    `program`: the shell inside the sandbox (None: bash, else sh). `user`: who runs it (a user
    name, a uid or uid:gid; None: the sandbox's default user). Raises TerminalEnded when the
    stream ends without an exit status, CorralError when the daemon refuses."""
    stdin_fd = sys.stdin.fileno()
    interactive = os.isatty(stdin_fd)
    requests: queue.SimpleQueue[shell_pb2.AttachRequest | None] = queue.SimpleQueue()
    rows, cols = _window_size()
    requests.put(
        _core.build_attach_start(
            sandbox_id, rows=rows, cols=cols, term=os.environ.get("TERM"), program=program, user=user
        )
    )

    def outgoing() -> Iterator[shell_pb2.AttachRequest]:
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
            # The local terminal hung up; the SIGHUP that comes with it ends this call (see
            # _raw_terminal), and there is nothing more to send.
            requests.put(None)
            return
        while not finished.is_set():
            requests.put(_core.build_attach_input(_END_OF_INPUT))
            finished.wait(_END_OF_INPUT_INTERVAL_S)

    def on_resize(_signum: int, _frame: object) -> None:
        requests.put(_core.build_attach_resize(*_window_size()))

    sys.stdout.flush()
    with _raw_terminal(stdin_fd if interactive else None):
        transport = client._transport
        responses = transport.interactive_stream(transport.shell_service.Attach, outgoing())
        previous_winch = signal.signal(signal.SIGWINCH, on_resize)
        try:
            # A daemon thread: a read blocked on the local terminal must not keep the process alive.
            threading.Thread(target=forward_stdin, name="corral-shell-stdin", daemon=True).start()
            for response in responses:
                item = _core.attach_output_or_exit(response)
                if isinstance(item, int):
                    return item
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
    raise TerminalEnded("the terminal ended without an exit status")


def _window_size() -> tuple[int, int]:
    """Rows and columns of the local terminal (80x24 when there is none)."""
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
        view = view[os.write(fd, view) :]


@contextlib.contextmanager
def _raw_terminal(fd: int | None) -> Iterator[None]:
    """Puts a terminal in raw mode for the duration of a `with` block and restores it on the way
    out, whatever ends the block (SIGTERM and SIGHUP included). Does nothing for fd None."""
    if fd is None:
        yield
        return
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
