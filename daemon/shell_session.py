"""A persistent shell session: bash under a host-side pty, one command per turn, end of command
found by a per-session random sentinel that carries the exit code.

How a turn works, and why:
- The command text goes to a file in the sandbox's run directory, and the shell gets one short
  line: `. FILE || rc=$?; printf SENTINEL`. Sourcing keeps state (cd, export, functions,
  `source venv/bin/activate`) in the shell; the line stays far below the terminal's 4 KiB line
  limit whatever the command's size; multi-line commands and heredocs need no quoting.
- The shell is non-interactive (its stderr is a pipe, not the pty): no prompt, so PS1 and
  PROMPT_COMMAND cannot disturb anything; no job-control chatter for `cmd &`; `set -e` inside a
  sourced `... ||` list cannot kill it. stdin and stdout stay on the pty, so programs see a
  terminal. `exec bash` starts another non-interactive bash on the same pty, which the session
  notices (the shell's command line changes) and resynchronises with.
- On timeout, the foreground gets SIGINT (the shell itself traps it and carries on to the
  sentinel), then end-of-file on the terminal (for `read x`, `cat`, a REPL), then SIGKILL; if the
  shell is beyond saving it is restarted and the result says so. Signals go to the processes of
  the session's cgroup, never to the host-side nsenter that holds the pty.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from corral.sdk.ansi import strip_ansi
from corral.sdk.errors import FailedPrecondition

from .backends.base import SandboxRuntime
from .fsaccess import create_private_file
from .output import HeadTailBuffer, utf8_safe
from .pty import Terminal

log = logging.getLogger(__name__)

START_TIMEOUT_S = 20.0
GRACE_S = 1.0
EXEC_POLL_S = 0.05
STRAY_LIMIT = 64 << 10
# What a timeout's SIGINT does: the shell's INT trap marks the turn aborted and installs a DEBUG
# trap that, with extdebug, skips every further command and unwinds functions and the sourced
# command file (returning 2 from a DEBUG trap simulates `return`); the turn line then removes it.
# Only commands read from stdin (the turn line itself) have an empty BASH_SOURCE. The DEBUG trap
# exists only after an interrupt, so normal commands pay nothing for it.
_BASH_INIT = (
    "set +m 2>/dev/null; \\builtin shopt -s extdebug 2>/dev/null; "
    "__corral_stop() { return 2; }; "
    "__corral_interrupted() { __corral_abort=1; "
    "\\builtin trap '(( ${#BASH_SOURCE[@]} == 0 )) || __corral_stop' DEBUG; }; "
)
_POSIX_INIT = "set +m 2>/dev/null; trap : INT; "


@dataclass(frozen=True)
class TurnResult:
    output: bytes
    exit_code: int
    timed_out: bool
    timeout_reason: str
    truncated: bool
    output_total: int
    duration_ms: int
    shell_restarted: bool


class _Turn:
    """Collects one command's output until the sentinel shows up in stdout."""

    def __init__(self, sentinel: re.Pattern[bytes], max_len: int, limit: int, stray: bytes) -> None:
        self.sentinel = sentinel
        self.max_len = max_len
        self.buffer = HeadTailBuffer(limit)
        self.buffer.write(stray)
        self.pending = b""  # stdout tail held back while it could be the start of a sentinel
        self.done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.last_output = time.monotonic()

    def on_stdout(self, data: bytes) -> None:
        self.last_output = time.monotonic()
        if self.done.done():
            return
        self.pending += data
        match = self.sentinel.search(self.pending)
        if match:
            self.buffer.write(self.pending[: match.start()])
            self.pending = b""
            self.done.set_result(int(match.group(1)))
            return
        cut = max(0, len(self.pending) - self.max_len)
        if cut:
            self.buffer.write(self.pending[:cut])
            self.pending = self.pending[cut:]

    def on_stderr(self, data: bytes) -> None:
        self.last_output = time.monotonic()
        if not self.done.done():
            self.buffer.write(data)

    def flush(self) -> None:
        self.buffer.write(self.pending)
        self.pending = b""


class ShellSession:
    def __init__(
        self,
        runtime: SandboxRuntime,
        name: str,
        *,
        env: dict[str, str],
        cwd: str,
        rows: int,
        cols: int,
        program: str,
        slot: int,
    ) -> None:
        self.runtime = runtime
        self.name = name
        self.env = env
        self.cwd = cwd
        self.size = (rows, cols)
        self.program = program
        self._bash = os.path.basename(program) == "bash"
        self.turns = 0
        self.restarts = 0
        self.token = secrets.token_hex(8)
        prefix = f"__CORRAL_{self.token}_".encode()
        self._sentinel = re.compile(b"\n" + re.escape(prefix) + rb"(-?\d+)__\n")
        self._sentinel_max = len(prefix) + 16
        self._cmd_host = Path(runtime.run_dir_host) / f"sh{slot}.cmd"
        self._cmd_sandbox = f"{runtime.run_dir_sandbox}/sh{slot}.cmd"
        self._terminal: Terminal | None = None
        self._cmd_fd: int | None = None
        self._turn: _Turn | None = None
        self._stray = bytearray()
        self._shell_cmdline = b""
        self._lock = asyncio.Lock()
        self.closed = False

    @property
    def pid(self) -> int:
        return self._terminal.pid if self._terminal else 0

    def _marker(self, rc_expr: str) -> str:
        # A fixed printf format, called past aliases and functions, so nothing the user redefines
        # changes the marker.
        printf = "\\builtin printf" if self._bash else "printf"
        return f"{printf} '\\n__CORRAL_{self.token}_%d__\\n' \"{rc_expr}\"\n"

    def _init_line(self) -> bytes:
        """Sets up the shell; sent at start and again after the shell exec'd a new one."""
        return ((_BASH_INIT if self._bash else _POSIX_INIT) + self._marker("0")).encode()

    def _turn_line(self) -> bytes:
        source = f"__corral_rc=0; . '{self._cmd_sandbox}' || __corral_rc=$?; "
        if not self._bash:  # plain sh: an interrupt stops the current command only
            return (source + self._marker("$__corral_rc")).encode()
        return (
            "\\builtin trap __corral_interrupted INT; __corral_abort=; "
            + source
            + "\\builtin trap - DEBUG; "
            + self._marker("$(( __corral_abort ? 130 : __corral_rc ))")
        ).encode()

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        argv = [self.program, "--noprofile", "--norc"] if self._bash else [self.program]
        enter = self.runtime.enter_command(argv, cwd=self.cwd, leaf=self.runtime.next_leaf("sh"), env=self.env)
        terminal = Terminal(
            enter.argv,
            env=enter.env,
            cwd=enter.cwd,
            rows=self.size[0],
            cols=self.size[1],
            cgroup=enter.cgroup,
            stderr_to_pipe=True,
            wrapped=enter.wrapped,
        )
        self._terminal = terminal
        terminal.attach(self._on_stdout, self._on_stderr)
        self._turn = _Turn(self._sentinel, self._sentinel_max, 1 << 16, b"")
        await terminal.write(self._init_line())
        try:
            await asyncio.wait_for(self._wait_turn_or_exit(self._turn, terminal), START_TIMEOUT_S)
        except TimeoutError:
            await terminal.close()
            raise RuntimeError(f"the shell did not start within {START_TIMEOUT_S:g}s") from None
        finally:
            self._turn = None
        if terminal.exited.done():
            raise RuntimeError(f"the shell exited at once (exit {terminal.exited.result()})")
        self._shell_cmdline = self._cmdline()

    def _write_command(self, data: bytes) -> None:
        # Overwrite in place and truncate after: opening with O_TRUNC costs ~0.1-0.3 ms a turn on
        # ext4, most of the daemon's own time in a turn; this costs a few microseconds.
        if self._cmd_fd is None:
            self._cmd_fd = create_private_file(self._cmd_host, 0o644)
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(self._cmd_fd, view[offset:], offset)
        os.ftruncate(self._cmd_fd, len(data))

    async def close(self) -> None:
        """Ends the session for good (a running turn fails with FAILED_PRECONDITION)."""
        self.closed = True
        await self._release()

    async def _release(self) -> None:
        if self._terminal:
            await self._terminal.close()
            self._terminal = None
        if self._cmd_fd is not None:
            os.close(self._cmd_fd)
            self._cmd_fd = None
        self._cmd_host.unlink(missing_ok=True)

    async def _restart(self) -> None:
        await self._release()
        self.restarts += 1
        self._stray.clear()
        await self.start()

    # -- output routing ------------------------------------------------------------------------------

    def _on_stdout(self, data: bytes) -> None:
        if self._turn:
            self._turn.on_stdout(data)
        elif len(self._stray) < STRAY_LIMIT:  # background output between turns goes to the next one
            self._stray += data[: STRAY_LIMIT - len(self._stray)]

    def _on_stderr(self, data: bytes) -> None:
        if self._turn:
            self._turn.on_stderr(data)
        elif len(self._stray) < STRAY_LIMIT:
            self._stray += data[: STRAY_LIMIT - len(self._stray)]

    def _cmdline(self) -> bytes:
        pid = self._terminal.shell_pid() if self._terminal else None
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
        except OSError:
            return b""

    # -- a turn --------------------------------------------------------------------------------------

    async def run(
        self, command: str, *, timeout_s: float, idle_timeout_s: float, output_limit: int, strip: bool
    ) -> tuple[TurnResult, bytes | None]:
        async with self._lock:
            result = await self._run_locked(command, timeout_s, idle_timeout_s, output_limit)
        return result, (strip_ansi(result.output) if strip else None)

    async def _run_locked(self, command: str, timeout_s: float, idle_timeout_s: float, limit: int) -> TurnResult:
        if self.closed:
            raise FailedPrecondition(f"shell {self.name!r} was closed")
        restarted = False
        if self._terminal is None or self._terminal.exited.done():
            await self._restart()
            restarted = True
        terminal = self._terminal
        if terminal is None:  # close() ran while the shell restarted
            raise FailedPrecondition(f"shell {self.name!r} was closed")
        started = time.monotonic()
        text = command if command.endswith("\n") else command + "\n"
        self._write_command(text.encode("utf-8", "surrogateescape"))
        turn = _Turn(self._sentinel, self._sentinel_max, limit, bytes(self._stray))
        self._stray.clear()
        self._turn = turn
        self.turns += 1
        timed_out, reason = False, ""
        try:
            try:
                await terminal.write(self._turn_line())
            except TimeoutError:  # the shell has not read its input for seconds: beyond saving
                outcome = "stuck"
            else:
                outcome = await self._wait(turn, terminal, started + timeout_s, idle_timeout_s)
            if outcome in ("timeout", "idle_timeout"):
                timed_out, reason = True, outcome
                outcome, eof_sent = await self._interrupt(turn, terminal)
                if outcome == "done" and eof_sent and not await self._responsive(terminal):
                    outcome = "eof_reached_shell"
        finally:
            self._turn = None
        turn.flush()
        if self.closed:
            raise FailedPrecondition(f"shell {self.name!r} was closed while the command ran")
        if outcome in ("done", "eof_reached_shell"):
            exit_code = turn.done.result()
        else:
            exit_code = terminal.exited.result() if terminal.exited.done() else 137
        if outcome != "done":  # the shell died, or could not be brought back: start a fresh one
            await self._restart()
            restarted = True
        output = turn.buffer.getvalue()
        if turn.buffer.truncated:
            output = utf8_safe(turn.buffer)
        return TurnResult(
            output=output,
            exit_code=exit_code,
            timed_out=timed_out,
            timeout_reason=reason,
            truncated=turn.buffer.truncated,
            output_total=turn.buffer.total,
            duration_ms=int((time.monotonic() - started) * 1000),
            shell_restarted=restarted,
        )

    async def _wait_turn_or_exit(self, turn: _Turn, terminal: Terminal) -> str:
        await asyncio.wait({turn.done, terminal.exited}, return_when=asyncio.FIRST_COMPLETED)
        return "done" if turn.done.done() else "exited"

    async def _wait(self, turn: _Turn, terminal: Terminal, deadline: float, idle_timeout_s: float) -> str:
        """Waits for the sentinel; returns "done", "exited", "timeout" or "idle_timeout"."""
        while True:
            now = time.monotonic()
            wake = deadline
            if idle_timeout_s:
                wake = min(wake, turn.last_output + idle_timeout_s)
            wake = min(wake, now + EXEC_POLL_S)  # also look for an exec'd shell now and then
            done, _ = await asyncio.wait(
                {turn.done, terminal.exited}, timeout=max(0.0, wake - now), return_when=asyncio.FIRST_COMPLETED
            )
            if turn.done.done():
                return "done"
            if terminal.exited.done():
                return "exited"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if idle_timeout_s and now - turn.last_output >= idle_timeout_s:
                return "idle_timeout"
            if self._cmdline() != self._shell_cmdline:
                # The shell exec'd another program (`exec bash`): this turn's line died with the
                # old process. Ask the new shell for the marker; a non-shell will time out.
                self._shell_cmdline = self._cmdline()
                await terminal.write(self._init_line())

    async def _interrupt(self, turn: _Turn, terminal: Terminal) -> tuple[str, bool]:
        """SIGINT, then end-of-file, then SIGKILL for the foreground; "done" once the shell prints
        its marker again, else "exited"/"stuck"; and whether the end-of-file was sent."""
        shell = terminal.shell_pid()

        async def end_of_file() -> None:
            with contextlib.suppress(TimeoutError):
                await terminal.write(b"\x04", timeout=GRACE_S)

        async def signal(sig: int, **kw) -> None:
            terminal.signal_inner(sig, **kw)

        steps = (
            lambda: signal(2, first=shell),
            end_of_file,
            lambda: signal(9, spare={shell} if shell else set()),
        )
        for number, step in enumerate(steps):
            await step()
            try:
                await asyncio.wait_for(self._wait_turn_or_exit(turn, terminal), GRACE_S)
            except TimeoutError:
                continue
            return ("done" if turn.done.done() else "exited"), number >= 1
        return "stuck", True

    async def _responsive(self, terminal: Terminal) -> bool:
        """Whether the shell still reads commands after an interrupt that sent end-of-file: when
        the foreground program did not read it (it ignored SIGINT and died of SIGKILL), the EOF
        waits in the terminal for the shell, and a non-interactive shell exits on it. One round
        trip tells, before the next command could be lost to a dying shell."""
        probe = _Turn(self._sentinel, self._sentinel_max, STRAY_LIMIT, b"")
        self._turn = probe
        try:
            with contextlib.suppress(TimeoutError):
                await terminal.write(self._marker("0").encode(), timeout=GRACE_S)
                await asyncio.wait_for(self._wait_turn_or_exit(probe, terminal), GRACE_S * 2)
        finally:
            self._turn = None
        probe.flush()
        self._stray += probe.buffer.getvalue()[:STRAY_LIMIT]  # output between turns goes to the next one
        return probe.done.done()
