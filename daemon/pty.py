"""A host-side pseudo-terminal running a program (usually "enter the sandbox, run bash").

The child is started with a plain spawn (vfork + exec) of util-linux `setsid --ctty`, which makes
the pty its controlling terminal. ptyprocess (and pty.fork) would fork the daemon's multi-threaded
interpreter and run Python in the child before exec, which is not safe next to gRPC's threads.
The master side is read with loop.add_reader; no thread per terminal.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import struct
import subprocess
import termios
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING

from .cgroups import CgroupGroup
from .process import READ_CHUNK, in_cgroup, write_all

if TYPE_CHECKING:
    from .backends.base import EnterCommand

# How long close() waits for the killed child's exit before leaving it to a reaping thread.
EXIT_GRACE_S = 5.0
# How soon to look again for an exit the pidfd reported before it could be collected.
EXIT_RETRY_S = 0.01


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class Terminal:
    """One pty with a child process; its output (stdout and stderr, in the order written) goes to
    `on_output`.

    A programmatic terminal (`interactive=False`) starts raw on output (no `\n` -> `\r\n`), without
    echo and without flow control, keeps canonical input (so ^D is end-of-file for a program that
    reads it), and keeps those modes: `reset()` puts them back and drops unread input, whatever a
    command did to the terminal (`stty sane`, `reset`, a full-screen program killed mid-way).

    `stderr`: a file descriptor the child gets as its stderr instead of the terminal (a shell
    session hands its command pipe over this way, on a one-digit fd that any sh can redirect)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        cwd: str,
        rows: int,
        cols: int,
        cgroup: CgroupGroup | None,
        wrapped: bool = True,
        interactive: bool = False,
        stderr: int | None = None,
    ) -> None:
        self.cgroup = cgroup
        self.wrapped = wrapped
        master, slave = os.openpty()
        set_size(master, rows, cols)
        if not interactive:
            attrs = termios.tcgetattr(slave)
            # For programmatic sessions: raw bytes out (no \n -> \r\n) and no echo of what we
            # type; canonical input stays on so that ^D is end-of-file for a program reading
            # the terminal. An interactive terminal keeps the usual settings.
            attrs[1] &= ~termios.ONLCR
            attrs[3] &= ~(termios.ECHO | termios.ECHONL)
            attrs[0] &= ~termios.IXON
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
        self._modes = termios.tcgetattr(slave)
        try:
            self._popen = subprocess.Popen(
                ["setsid", "--ctty", *in_cgroup(argv, cgroup)],
                stdin=slave,
                stdout=slave,
                stderr=stderr if stderr is not None else slave,
                env=env,
                cwd=cwd,
                close_fds=True,
            )
        except BaseException:
            os.close(master)
            os.close(slave)
            raise
        # The daemon keeps the slave side open (close-on-exec) to put the modes back before each
        # command; the child's exit is seen through its pidfd, not through the terminal hanging up.
        self.slave: int | None = slave if not interactive else None
        if interactive:
            os.close(slave)
        self.pid = self._popen.pid
        self.master = master
        os.set_blocking(master, False)
        self._pidfd = os.pidfd_open(self.pid)
        self.exited: asyncio.Future = asyncio.get_running_loop().create_future()
        self._readers: list[int] = []
        self._exit_retry: asyncio.TimerHandle | None = None

    @classmethod
    def entering(cls, enter: EnterCommand, *, rows: int, cols: int, interactive: bool) -> Terminal:
        """A terminal running a backend's "enter the sandbox" command line."""
        return cls(
            enter.argv,
            env=enter.env,
            cwd=enter.cwd,
            rows=rows,
            cols=cols,
            cgroup=enter.cgroup,
            wrapped=enter.wrapped,
            interactive=interactive,
        )

    def attach(self, on_output: Callable[[bytes], None]) -> None:
        """Starts delivering output. Called once."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self._pidfd, self._on_exit)
        loop.add_reader(self.master, self._pump, self.master, on_output)
        self._readers = [self._pidfd, self.master]

    def _pump(self, fd: int, sink: Callable[[bytes], None]) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:  # EIO: the slave side is closed (every process holding it is gone)
            data = b""
        if data:
            sink(data)
        else:
            asyncio.get_running_loop().remove_reader(fd)

    def drain(self, fd: int, sink: Callable[[bytes], None], limit: int | None = None) -> None:
        """Reads whatever is buffered now, without waiting (at most about `limit` bytes: a writer
        that keeps writing would otherwise keep this reading)."""
        taken = 0
        while limit is None or taken < limit:
            try:
                data = os.read(fd, READ_CHUNK)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            taken += len(data)
            sink(data)

    def _on_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._collect_exit()

    def _collect_exit(self) -> None:
        self._exit_retry = None
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:
            # The pidfd can report the exit a moment before the kernel lets it be collected:
            # look again shortly, or the exit would never be seen.
            self._exit_retry = asyncio.get_running_loop().call_later(EXIT_RETRY_S, self._collect_exit)
            return
        self._popen.returncode = status
        code = os.waitstatus_to_exitcode(status)
        if not self.exited.done():
            self.exited.set_result(code if code >= 0 else 128 - code)

    async def write(self, data: bytes, timeout: float = 10.0) -> None:
        """Writes input, waiting (without blocking the loop) while the terminal's input buffer is
        full; TimeoutError if the program has not read it after `timeout`."""
        await write_all(self.master, data, timeout)

    def reset(self) -> None:
        """Puts the terminal's modes back to what it started with and drops input nobody read
        (a leftover ^D or keystrokes meant for a program that is gone)."""
        if self.slave is not None:
            if termios.tcgetattr(self.slave) != self._modes:  # reading them costs a fifth of setting
                termios.tcsetattr(self.slave, termios.TCSANOW, self._modes)
            termios.tcflush(self.slave, termios.TCIFLUSH)

    def resize(self, rows: int, cols: int) -> None:
        set_size(self.master, rows, cols)  # the kernel sends SIGWINCH to the foreground group

    def inner_pids(self) -> set[int]:
        """Processes started inside the terminal, without the host-side wrapper (nsenter, which
        must not die of a signal meant for the shell's commands)."""
        if self.cgroup is not None:
            return self.cgroup.pids() - ({self.pid} if self.wrapped else set())
        try:
            pgid = os.getpgid(self.pid)
        except ProcessLookupError:
            return set()
        return {p for p in _all_pids() if _pgid(p) == pgid}

    def shell_pid(self) -> int | None:
        """The first process inside (the shell): the wrapper's child, or the spawned process itself
        when nothing wraps it."""
        if not self.wrapped:
            return self.pid
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def signal_inner(self, sig: int, *, spare: AbstractSet[int] = frozenset(), first: int | None = None) -> None:
        """Sends `sig` to the processes inside, `first` before the others (the shell must see
        SIGINT before its foreground child dies of it, or it would run on to the next command)."""
        targets = self.inner_pids() - set(spare)
        ordered = ([first] if first in targets else []) + [p for p in targets if p != first]
        for pid in ordered:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    async def close(self) -> None:
        """Kills everything in the terminal and releases it."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)
        if not self.exited.done():  # the pidfd reader is still on: it reaps the wrapper
            try:
                await asyncio.wait_for(asyncio.shield(self.exited), EXIT_GRACE_S)
            except TimeoutError:
                # Still not dead (stuck in the kernel on a loaded node): a thread reaps it whenever
                # it goes, so that no zombie outlives the closed pidfd.
                asyncio.get_running_loop().run_in_executor(None, self._popen.wait)
        if self._exit_retry is not None:
            self._exit_retry.cancel()
        loop = asyncio.get_running_loop()
        for fd in self._readers:
            loop.remove_reader(fd)
        self._readers = []
        for owned_fd in (self.master, self.slave, self._pidfd):
            if owned_fd is not None:
                try:
                    os.close(owned_fd)
                except OSError:
                    pass
        if self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.remove)


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1
