"""ProcessManager: background processes in sandboxes, each under a pty of its own, started without
waiting for them. Their output goes to a bounded ring buffer that callers read by offset (so a
slow reader learns how much it missed), while they type input, send signals and wait with a
timeout: what an expect-driven REPL, an agent's terminal tool or a server left running need."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from dataclasses import dataclass

from corral.sdk.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

from . import rules
from .commands import sandbox_environment
from .config import Config
from .files import FileManager
from .pty import Terminal
from .sandboxes import SandboxManager

PROCESS_SIZE = (24, 80)
DEFAULT_BUFFER_BYTES = 1 << 20
MIN_BUFFER_BYTES = 1 << 10
MAX_BUFFER_BYTES = 4 << 20
# Per sandbox: processes kept (running or finished, until closed) and their buffers together.
MAX_PROCESSES_PER_SANDBOX = 32
MAX_BUFFERED_BYTES_PER_SANDBOX = 32 << 20
DEFAULT_READ_BYTES = 1 << 20
MAX_READ_BYTES = 4 << 20
MAX_INPUT_BYTES = 1 << 20
# Input the program has not read after this long is refused (it is not reading its terminal).
INPUT_TIMEOUT_S = 10.0


class OutputRing:
    """The last `capacity` bytes of a stream, addressed by their offset in the whole stream.

    The buffer grows up to twice the capacity before its head is cut, so that appending stays
    cheap under a flood (one move per `capacity` bytes, not one per chunk)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data = bytearray()
        self._base = 0  # the stream offset of _data[0]

    @property
    def end(self) -> int:
        return self._base + len(self._data)

    @property
    def start(self) -> int:
        """The offset of the oldest byte still kept."""
        return max(self._base, self.end - self.capacity)

    def append(self, data: bytes) -> None:
        self._data += data
        excess = len(self._data) - 2 * self.capacity
        if excess > 0:
            cut = excess + self.capacity
            del self._data[:cut]
            self._base += cut

    def read(self, offset: int, limit: int) -> tuple[int, bytes]:
        """(where the bytes start, up to `limit` bytes from `offset` on, or from the oldest kept
        byte when those were dropped)."""
        if offset > self.end:
            raise InvalidArgument(f"offset {offset} is past the end of the output ({self.end} bytes so far)")
        first = max(offset, self.start)
        index = first - self._base
        return first, bytes(self._data[index : index + limit])


@dataclass
class ProcessSnapshot:
    process_id: str
    sandbox_id: str
    argv: list[str]
    pid: int
    running: bool
    exit_code: int
    output_end: int
    output_start: int


class BackgroundProcess:
    """One process and its output; `finished` is set once it has ended and its terminal is closed."""

    def __init__(self, process_id: str, sandbox_id: str, argv: list[str], terminal: Terminal, capacity: int) -> None:
        self.process_id = process_id
        self.sandbox_id = sandbox_id
        self.argv = argv
        self.terminal = terminal
        self.output = OutputRing(capacity)
        self.exit_code: int | None = None
        self.finished = asyncio.Event()
        self._news = asyncio.Event()  # set (and replaced) whenever output comes or the process ends
        self._closing: asyncio.Future | None = None
        terminal.attach(self._on_output)
        self._watcher = asyncio.ensure_future(self._watch())

    @property
    def running(self) -> bool:
        return self.exit_code is None

    def snapshot(self) -> ProcessSnapshot:
        return ProcessSnapshot(
            self.process_id,
            self.sandbox_id,
            list(self.argv),
            self.terminal.pid,
            self.running,
            self.exit_code or 0,
            self.output.end,
            self.output.start,
        )

    def _on_output(self, data: bytes) -> None:
        self.output.append(data)
        self._notify()

    def _notify(self) -> None:
        news, self._news = self._news, asyncio.Event()
        news.set()

    def _close_terminal(self) -> asyncio.Future:
        """Kills what still runs on the terminal and releases it, once (a second close of its
        descriptors could close someone else's)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self.terminal.close())
        return self._closing

    async def _watch(self) -> None:
        code = await self.terminal.exited
        if self._closing is None:  # the terminal's descriptors are still its own
            self.terminal.drain(self.terminal.master, self.output.append)
        # Whatever the command left running goes with it: a process is over when its command is,
        # and a finished process holds no host resources, only its output.
        await self._close_terminal()
        self.exit_code = code
        self.finished.set()
        self._notify()

    async def output_after(self, offset: int, wait_s: float) -> None:
        """Returns once there is output past `offset` or the process has ended, or after `wait_s`."""
        news = self._news
        if wait_s <= 0 or offset < self.output.end or not self.running:
            return
        try:
            await asyncio.wait_for(news.wait(), wait_s)
        except TimeoutError:
            pass

    async def write(self, data: bytes) -> None:
        if not self.running:
            raise FailedPrecondition(f"process {self.process_id} has ended (exit code {self.exit_code})")
        try:
            await self.terminal.write(data, timeout=INPUT_TIMEOUT_S)
        except TimeoutError:
            raise ResourceExhausted(
                f"process {self.process_id} has not read its input for {INPUT_TIMEOUT_S:g} s"
            ) from None
        except OSError as err:  # the terminal went away as it ended
            raise FailedPrecondition(f"process {self.process_id} has ended: {err}") from None

    def signal(self, number: int) -> None:
        """The command first, then everything it started."""
        if self.running:
            self.terminal.signal_inner(number, first=self.terminal.shell_pid())

    async def close(self) -> None:
        await self._close_terminal()
        if self.terminal.exited.done():
            await self._watcher
        else:  # the wrapper outlived SIGKILL's grace: no exit code will come
            self._watcher.cancel()


class ProcessManager:
    def __init__(self, config: Config, sandboxes: SandboxManager, files: FileManager) -> None:
        self.config = config
        self.sandboxes = sandboxes
        self.files = files
        self._processes: dict[str, dict[str, BackgroundProcess]] = {}
        self._ids = itertools.count(1)
        sandboxes.on_destroy(self.close_sandbox)

    async def start(
        self,
        sandbox_id: str,
        *,
        argv: list[str],
        shell: str,
        env: dict[str, str],
        cwd: str,
        user: str,
        size: tuple[int, int] | None,
        term: str,
        interactive: bool,
        buffer_bytes: int,
    ) -> BackgroundProcess:
        if bool(argv) == bool(shell):
            raise InvalidArgument("give the command as argv or as a shell string (exactly one)")
        if argv and not argv[0]:
            raise InvalidArgument("argv[0] is empty")
        for arg in [*argv, shell, term]:
            rules.no_nul("command", arg)
        env = rules.environment(env)
        cwd = rules.working_directory(cwd)
        user = rules.user(user)
        rows, cols = rules.terminal_size(size) or PROCESS_SIZE
        capacity = rules.in_range("buffer_bytes", buffer_bytes, MIN_BUFFER_BYTES, MAX_BUFFER_BYTES, "bytes", "1 MiB")
        capacity = capacity or DEFAULT_BUFFER_BYTES
        with self.sandboxes.using(sandbox_id) as sandbox:
            processes = self._processes.setdefault(sandbox_id, {})
            cwd = await self.files.command_directory(sandbox, cwd)
            self._make_room(sandbox_id, processes, capacity)
            runtime = sandbox.runtime
            command = argv or runtime.shell_argv(shell)
            enter = runtime.enter_command(
                command,
                cwd=cwd,
                leaf=runtime.next_leaf("bg"),
                env=sandbox_environment(runtime.home(user), sandbox.env, {"TERM": term or "dumb", **env}),
                user=user,
            )
            terminal = Terminal.entering(enter, rows=rows, cols=cols, interactive=interactive)
            process_id = f"p{next(self._ids)}-{secrets.token_hex(4)}"
            process = BackgroundProcess(process_id, sandbox_id, list(command), terminal, capacity)
            processes[process_id] = process
            return process

    def _make_room(self, sandbox_id: str, processes: dict[str, BackgroundProcess], capacity: int) -> None:
        """Forgets finished processes, oldest first, until a new one with `capacity` fits."""

        def fits() -> bool:
            buffered = sum(p.output.capacity for p in processes.values())
            return len(processes) < MAX_PROCESSES_PER_SANDBOX and buffered + capacity <= MAX_BUFFERED_BYTES_PER_SANDBOX

        for process_id in [pid for pid, p in processes.items() if not p.running]:
            if fits():
                return
            processes.pop(process_id)
        if not fits():
            raise ResourceExhausted(
                f"sandbox {sandbox_id} already runs {len(processes)} background processes buffering "
                f"{sum(p.output.capacity for p in processes.values())} bytes (at most {MAX_PROCESSES_PER_SANDBOX} "
                f"processes and {MAX_BUFFERED_BYTES_PER_SANDBOX} bytes); close some first"
            )

    def get(self, sandbox_id: str, process_id: str) -> BackgroundProcess:
        self.sandboxes.get(sandbox_id)  # NOT_FOUND for an unknown sandbox first
        process = self._processes.get(sandbox_id, {}).get(process_id)
        if process is None:
            raise NotFound(f"sandbox {sandbox_id} has no background process {process_id!r}")
        return process

    async def read(
        self, sandbox_id: str, process_id: str, *, offset: int, max_bytes: int, wait_ms: int
    ) -> tuple[int, bytes, ProcessSnapshot]:
        """(where the bytes start, the bytes, the process after the read)."""
        limit = rules.in_range("max_bytes", max_bytes, 1, MAX_READ_BYTES, "bytes", "1 MiB") or DEFAULT_READ_BYTES
        wait_s = self._wait_s("wait_ms", wait_ms)
        process = self.get(sandbox_id, process_id)
        process.output.read(offset, 0)  # INVALID_ARGUMENT for an offset past the end, before waiting
        with self.sandboxes.using(sandbox_id):
            await process.output_after(offset, wait_s)
        start, data = process.output.read(offset, limit)
        return start, data, process.snapshot()

    async def write(self, sandbox_id: str, process_id: str, data: bytes) -> None:
        if len(data) > MAX_INPUT_BYTES:
            raise InvalidArgument(f"input is {len(data)} bytes; at most {MAX_INPUT_BYTES} per call")
        process = self.get(sandbox_id, process_id)
        with self.sandboxes.using(sandbox_id):
            await process.write(data)

    def signal(self, sandbox_id: str, process_id: str, number: int) -> ProcessSnapshot:
        number = rules.signal_number(number)
        process = self.get(sandbox_id, process_id)
        with self.sandboxes.using(sandbox_id):
            process.signal(number)
        return process.snapshot()

    async def wait(self, sandbox_id: str, process_id: str, timeout_ms: int) -> ProcessSnapshot:
        wait_s = self._wait_s("timeout_ms", timeout_ms)
        process = self.get(sandbox_id, process_id)
        if wait_s > 0 and process.running:
            with self.sandboxes.using(sandbox_id):
                try:
                    await asyncio.wait_for(process.finished.wait(), wait_s)
                except TimeoutError:
                    pass
        return process.snapshot()

    def _wait_s(self, field: str, value_ms: int) -> float:
        return rules.in_range(field, value_ms, 0, int(self.config.exec.max_timeout_s * 1000), "ms") / 1000

    def list(self, sandbox_id: str) -> list[ProcessSnapshot]:
        self.sandboxes.get(sandbox_id)
        return [p.snapshot() for p in self._processes.get(sandbox_id, {}).values()]

    async def close_process(self, sandbox_id: str, process_id: str) -> None:
        process = self.get(sandbox_id, process_id)
        self._processes[sandbox_id].pop(process_id, None)
        await process.close()

    async def close_sandbox(self, sandbox_id: str) -> None:
        processes = self._processes.pop(sandbox_id, {})
        await asyncio.gather(*(p.close() for p in processes.values()), return_exceptions=True)

    async def close(self) -> None:
        await asyncio.gather(*(self.close_sandbox(sid) for sid in list(self._processes)), return_exceptions=True)
