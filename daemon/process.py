"""Host-side child processes driven by the event loop: pipes and a pidfd under loop.add_reader.

No thread per process and no polling: output arrives as the pipes become readable, exit is seen
through a pidfd. A process always runs in its own process group (and, where the daemon has
cgroups, in its own leaf cgroup), so `kill_tree` reaches every descendant, including ones that
left the group with setsid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterable, Callable, Sequence
from dataclasses import dataclass

from .cgroups import CgroupGroup

log = logging.getLogger(__name__)

STDOUT = 1
STDERR = 2
READ_CHUNK = 1 << 16
KILL_WAIT_S = 5.0
# The pidfd can report an exit a moment before the kernel lets it be collected: how often and how
# long to look again before taking the process for one stuck in the kernel.
COLLECT_RETRY_S = 0.005
COLLECT_RETRIES = 200


@dataclass(frozen=True)
class ProcessExit:
    exit_code: int  # 128 + signal when killed by a signal
    signal: int
    timed_out: bool
    duration_ms: int


# Sets its oom_score_adj to the first argument ("": left as inherited), joins the cgroups named by
# the next N arguments, then execs the rest. Writing "0" to cgroup.procs moves the writer itself,
# so the command and all it forks are accounted from its first instruction (and, where root has
# CAP_SYS_RESOURCE, the oom_score_adj it set is also the floor the command cannot go below). A
# tiny /bin/sh step instead of a Python preexec_fn: forking the daemon's multi-threaded
# interpreter and running Python in the child is not safe (gRPC's threads), while a plain spawn
# (vfork + exec) is.
_JOIN_SCRIPT = (
    'adj=$1; shift; if [ -n "$adj" ]; then echo "$adj" > /proc/self/oom_score_adj || exit 125; fi; '
    'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
)


def in_cgroup(argv: Sequence[str], cgroup: CgroupGroup | None) -> list[str]:
    """argv wrapped so that it starts inside `cgroup` (unchanged when there is none)."""
    if cgroup is None:
        return list(argv)
    files = cgroup.procs_files
    adj = str(cgroup.oom_score_adj) if cgroup.oom_score_adj else ""
    return ["/bin/sh", "-c", _JOIN_SCRIPT, "corral-join", adj, str(len(files)), *files, *argv]


def is_process(pid: int, names: tuple[str, ...]) -> bool:
    """Whether `pid` runs a program called one of `names` (a recorded pid may be another's now)."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip() in names
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(child) for child in fh.read().split()]
        except OSError:
            continue
    return found


def kill_descendants(pid: int, rounds: int = 8) -> None:
    """SIGKILLs every descendant of `pid` (not `pid` itself), for processes without a cgroup of
    their own. Each one found is stopped first, so that it cannot fork past the walk, and the walk
    is repeated until it finds none new; all are then killed together. A process that left the
    tree (its parent exited before the walk: a double fork) is out of reach."""
    stopped: list[int] = []
    seen: set[int] = set()
    for _ in range(rounds):
        frontier, new = [pid], []
        while frontier:
            for child in _children(frontier.pop()):
                if child not in seen:
                    seen.add(child)
                    new.append(child)
                frontier.append(child)
        if not new:
            break
        for child in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGSTOP)
        stopped += new
    for child in stopped:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(child, signal.SIGKILL)


def _decode_wait_status(status: int) -> tuple[int, int]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return 128 + sig, sig
    return os.WEXITSTATUS(status), 0


class HostProcess:
    """A started child process; `run` feeds its output to a callback until it exits."""

    _status: int  # the wait status, once _reap has run

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str],
        stdin: bytes | AsyncIterable[bytes] | None,
        cgroup: CgroupGroup | None = None,
        cwd: str = "/",
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """`on_done` runs once `run` has returned or raised, the main process reaped (its leaf
        cgroup handed back to its sandbox there)."""
        self.cgroup = cgroup
        self._on_done = on_done
        # A leaf may be reused from an earlier command: its OOM kills before now are not ours.
        self._oom_base = cgroup.oom_kills() if cgroup else 0
        self._stdin_data = stdin
        self.started = time.monotonic()
        self._popen = subprocess.Popen(
            in_cgroup(argv, cgroup),
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            process_group=0,
        )
        self.pid = self._popen.pid
        self._pidfd = os.pidfd_open(self.pid)
        self._exited = False
        self._stdin_error: Exception | None = None
        # The output pipes being read (fd -> stream, callback) while `run` runs; paused: not read.
        self._readers: dict[int, tuple[int, Callable[[int, bytes], None]]] = {}
        self._paused = False

    def oom_kills(self) -> int:
        """OOM kills in the process's leaf cgroup since it started (0 without one)."""
        return self.cgroup.oom_kills() - self._oom_base if self.cgroup else 0

    async def run(self, on_output: Callable[[int, bytes], None], timeout: float | None) -> ProcessExit:
        """Waits for the main process to exit (or the timeout to kill the tree), forwarding output.

        Returns once the main process has exited: descendants left in the background keep
        running but no longer hold the call open; their pending output is read once, not waited for.
        Cancellation kills the whole tree before re-raising.
        """
        try:
            return await self._run(on_output, timeout)
        finally:
            on_done, self._on_done = self._on_done, None
            if on_done is not None:
                on_done()

    async def _run(self, on_output: Callable[[int, bytes], None], timeout: float | None) -> ProcessExit:
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(self._pidfd, on_exit)
        # Both are pipes (stdout=PIPE, stderr=PIPE in __init__).
        assert self._popen.stdout is not None and self._popen.stderr is not None
        pipes = {self._popen.stdout.fileno(): STDOUT, self._popen.stderr.fileno(): STDERR}
        for fd, stream in pipes.items():
            os.set_blocking(fd, False)
            self._readers[fd] = (stream, on_output)
            loop.add_reader(fd, self._read_once, fd, stream, on_output)
        stdin_task = asyncio.ensure_future(self._feed_stdin()) if self._stdin_data is not None else None
        timed_out = False
        try:
            try:
                await asyncio.wait_for(asyncio.shield(exited), timeout)
            except TimeoutError:
                timed_out = True
                await self.kill_tree()
                try:
                    await asyncio.wait_for(asyncio.shield(exited), KILL_WAIT_S)
                except TimeoutError:  # stuck in the kernel (D state): report it killed anyway
                    log.warning("process %d did not die within %ss of SIGKILL", self.pid, KILL_WAIT_S)
        except BaseException:
            # Cancelled (the client went away) or the tree would not die: kill it, wait a little
            # for the main process so that it is reaped, release the fds, let the error travel on.
            await self.kill_tree()
            try:
                await asyncio.wait_for(asyncio.shield(exited), KILL_WAIT_S)
            except (TimeoutError, asyncio.CancelledError):
                pass
            loop.remove_reader(self._pidfd)
            self._reap()
            self._close()
            raise
        finally:
            loop.remove_reader(self._pidfd)
            self._readers.clear()
            for fd in pipes:
                loop.remove_reader(fd)
            if stdin_task:
                stdin_task.cancel()
            if exited.done():
                await self._collect_exit()
            self._reap()
        for fd, stream in pipes.items():
            self._drain(fd, stream, on_output)
        self._close()
        if self._stdin_error is not None:
            raise self._stdin_error
        exit_code, sig = _decode_wait_status(self._status)
        return ProcessExit(exit_code, sig, timed_out, int((time.monotonic() - self.started) * 1000))

    def _read_once(self, fd: int, stream: int, on_output: Callable[[int, bytes], None]) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            on_output(stream, data)
        else:
            self._readers.pop(fd, None)
            asyncio.get_running_loop().remove_reader(fd)

    def pause_output(self) -> None:
        """Stops reading stdout and stderr until `resume_output`: the pipes fill and the command
        blocks on its next write, so a consumer slower than the command bounds what is buffered.
        The exit is still seen; once the main process exits, what its pipes hold is read."""
        if not self._paused:
            self._paused = True
            loop = asyncio.get_running_loop()
            for fd in self._readers:
                loop.remove_reader(fd)

    def resume_output(self) -> None:
        if self._paused:
            self._paused = False
            loop = asyncio.get_running_loop()
            for fd, (stream, on_output) in self._readers.items():
                loop.add_reader(fd, self._read_once, fd, stream, on_output)

    def _drain(self, fd: int, stream: int, on_output: Callable[[int, bytes], None]) -> None:
        while True:
            try:
                data = os.read(fd, READ_CHUNK)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            on_output(stream, data)

    async def _feed_stdin(self) -> None:
        """Writes stdin (bytes, or an async stream of chunks) without blocking, then closes it."""
        pipe = self._popen.stdin
        data = self._stdin_data
        # Only started when there is stdin data, and then stdin is a pipe.
        assert pipe is not None and data is not None
        fd = pipe.fileno()
        os.set_blocking(fd, False)
        try:
            if isinstance(data, (bytes, bytearray, memoryview)):
                await write_all(fd, data)
            else:
                async for chunk in data:
                    await write_all(fd, chunk)
        except (BrokenPipeError, OSError):
            pass  # the command closed its stdin early; that is its business
        except Exception as err:  # noqa: BLE001 - the input stream itself failed (a bad request)
            # The command must not go on with half its input as if it were all (a tar that
            # unpacks a truncated archive): kill it, and make run() raise this error instead.
            self._stdin_error = err
            await self.kill_tree()
        finally:
            pipe.close()

    async def kill_tree(self) -> None:
        """SIGKILLs the process group and, where there is one, every process in the cgroup;
        without a cgroup, every descendant of the process first (those that left the group with
        setsid, whose parent still lives)."""
        if not self.cgroup:
            await asyncio.to_thread(kill_descendants, self.pid)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup:
            await asyncio.to_thread(self.cgroup.kill)

    async def _collect_exit(self) -> None:
        """The pidfd said the process ended: collect its status, looking again while the kernel
        does not yet let it be collected (else a normal exit would read as SIGKILL, 137)."""
        for _ in range(COLLECT_RETRIES):
            if self._exited:
                return
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._set_status(status)
                return
            await asyncio.sleep(COLLECT_RETRY_S)

    def _set_status(self, status: int) -> None:
        self._status = status
        self._exited = True
        self._popen.returncode = _decode_wait_status(status)[0]  # so Popen never waits again

    def _reap(self) -> None:
        if self._exited:
            return
        pid, status = os.waitpid(self.pid, os.WNOHANG)
        if pid == 0:  # unkillable (stuck in the kernel): report it killed, reap it later
            self._status, self._exited = signal.SIGKILL, True
            self._popen.returncode = None
            return
        self._set_status(status)

    def _close(self) -> None:
        os.close(self._pidfd)
        for pipe in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            if pipe:
                pipe.close()


async def _ready(
    fd: int, watch: Callable[..., object], unwatch: Callable[[int], object], deadline: float | None
) -> None:
    """Waits on the event loop until `fd` is ready (`watch`/`unwatch`: the loop's add_reader and
    remove_reader, or add_writer and remove_writer); TimeoutError past `deadline` (loop time)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    watch(fd, _resolve_once, ready)
    try:
        await asyncio.wait_for(ready, None if deadline is None else max(0.0, deadline - loop.time()))
    finally:
        unwatch(fd)


def _resolve_once(future: asyncio.Future) -> None:
    # (The loop may call a watcher again before the waiting task runs and removes it.)
    if not future.done():
        future.set_result(None)


async def write_all(fd: int, data: bytes, timeout: float | None = None) -> None:
    """Writes all of `data` to a non-blocking fd, waiting on the event loop (add_writer) while it
    is full; TimeoutError when the reader has not made room within `timeout`."""
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    deadline = None if timeout is None else loop.time() + timeout
    while view:
        try:
            view = view[os.write(fd, view[:READ_CHUNK]) :]
            continue
        except BlockingIOError:
            pass
        await _ready(fd, loop.add_writer, loop.remove_writer, deadline)


async def read_line(fd: int, timeout: float, limit: int = 4096) -> bytes:
    """The next line a child writes to the pipe `fd` (with its newline; shorter at end of file or
    past `limit` bytes), waited for on the event loop (add_reader), not in a worker thread: many
    sandboxes starting at once (a fork's children) would otherwise each hold one of the loop's few
    workers until their init answers, and queue the other steps of every start behind them.
    Reads byte by byte, so nothing after the line is taken from the pipe; leaves the pipe's
    blocking mode as it found it. TimeoutError when no line came within `timeout`."""
    loop = asyncio.get_running_loop()
    blocking = os.get_blocking(fd)
    os.set_blocking(fd, False)
    line = bytearray()
    deadline = loop.time() + timeout
    try:
        while len(line) < limit:
            try:
                byte = os.read(fd, 1)
            except BlockingIOError:
                await _ready(fd, loop.add_reader, loop.remove_reader, deadline)
                continue
            line += byte
            if not byte or byte == b"\n":
                break
        return bytes(line)
    finally:
        os.set_blocking(fd, blocking)
