"""A persistent shell session: bash with its terminal on a host-side pty, its commands fed through a
pipe, one command per turn, the end of each turn framed so that no command can break or forge it.

How a turn works, and why (docs/shells.md has the whole story):
- The shell reads its commands from a pipe only the daemon writes. Its stdout and stderr are the
  pty, so a command's output arrives as one stream in the order it was written, and programs see a
  terminal (commands get the terminal as stdin too). Reading commands from a pipe keeps the shell
  non-interactive whatever its output is (no prompt, no job-control chatter, no echo of commands),
  and nothing a command writes to or reads from the terminal can reach the shell's input.
- The command text goes to a file in the sandbox's run directory; the turn line sources it
  (`. FILE <>/dev/tty >&0 2>&0`), so cd, export, functions and `source venv/bin/activate`
  persist, the line stays short whatever the command's size, and bash reports errors with the
  command's own line numbers. bash labels them with the file's path; the daemon writes `bash`
  wherever the path shows, as `bash -c` would.
- The turn line's own commands run with stdout and stderr on /dev/null and with the user's
  xtrace, verbose and history options off, so nothing set up to show what the shell reads or
  runs (`set -x`, `set -v`, a DEBUG trap, history) shows the session's own line.
- The end of a turn is a line printed in-band on the terminal (so it comes after every byte the
  command wrote), carrying the exit code and a fresh random nonce per turn, so a marker a command
  prints itself (or saw in an earlier turn) ends nothing. It is printed by `trap -p` with the
  shell in POSIX mode, where special builtins outrank functions: no function or alias a command
  defines (`builtin`, `printf`, `trap`) can take it over. It is removed from the output. What
  follows it (background jobs) goes to the next turn; a shell that exits instead has its terminal
  read to the end first.
- Before each turn the daemon puts the terminal's modes back and drops unread input, so `stty
  sane`, `reset` or a full-screen program killed mid-way change nothing for the next turn.
- On timeout: the reserved abort signal to the shell (its trap then unwinds the sourced command)
  and SIGINT to the processes this turn started, end-of-file on the terminal, then SIGKILL to
  them; once the turn has ended, what it started is killed except the background jobs it left at
  the shell's top level.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from corral.sdk.ansi import strip_ansi
from corral.sdk.errors import FailedPrecondition

from .backends.base import SandboxRuntime
from .fsaccess import create_private_fifo, create_private_file
from .output import HeadTailBuffer, utf8_safe
from .process import write_all
from .pty import Terminal

log = logging.getLogger(__name__)

START_TIMEOUT_S = 20.0
GRACE_S = 1.0
EXEC_POLL_S = 0.05
STRAY_LIMIT = 64 << 10
# More than a terminal holds (Linux lets a pty's flip buffers grow past 1 MiB, plus 4 KiB in its line
# discipline): what a shell wrote before it exited is all read, and a writer that lives on cannot
# keep the daemon reading.
DRAIN_LIMIT = 4 << 20
# Two signals no program uses, which the session reserves: the marker's trap carries the end of
# a turn for a moment (printed with `trap -p`, then removed); the abort signal's trap stops a
# timed-out command (the user's own INT trap, if any, is left alone).
MARKER_SIGNAL = "RTMAX-3"
ABORT_SIGNAL = "RTMAX-4"
ABORT_SIGNUM = signal.SIGRTMAX - 4

# After an interrupt: a DEBUG trap that runs `return` returns from the function or sourced file
# the shell is in, before its next command, so every further command of the sourced command (and
# of the functions it is in) is skipped; at the turn line's level (BASH_SOURCE empty) it does
# nothing. POSIX mode first: there `return` is a special builtin, which no function can shadow.
# (No extdebug: kept on for the session, it would change what the user's shell does: `declare -F`
# showing source files, DEBUG and RETURN traps reaching into functions and subshells.)
_DEBUG_TRAP = (
    "[[ -z $__corral_abort || $BASH_COMMAND == __corral_end* ]] || "
    "{ POSIXLY_CORRECT=y; (( ${#BASH_SOURCE[@]} )) && \\return 2; }"
)
# What the marker's `trap -p` prints: trap -- '__CORRAL_<nonce>_<exit code>_<options>' <signal>, the
# options being those of the user's that the turn line switches off around itself (x: xtrace,
# v: verbose, h: history). One pattern for every turn (compiling one per nonce would cost more than
# the rest of a turn); the nonce is compared after.
_MARKER = re.compile(rb"trap -- '__CORRAL_([0-9a-f]{16})_(-?\d+)_([xvh]*)' [^\r\n]*\r?\n")

# `less` and `more` in a session: nobody pages through a programmatic terminal, so they print their
# input as cat does (PAGER=cat and the like cover the programs that page on their own).
_PAGER_SCRIPT = b"""#!/bin/sh
# less and more in a corral shell session print their input, as cat does; their options are ignored.
while [ $# -gt 0 ]; do
  case $1 in --) shift; break ;; -*|+*) shift ;; *) break ;; esac
done
exec cat -- "$@"
"""
# The options the turn line switches off at its end and back on before the next command, by the
# letter the marker reports them with.
_OPTION_ON = {"x": "-x", "v": "-v", "h": "-o history"}
_ABORT_TRAP = "__corral_abort=1; POSIXLY_CORRECT=y; \\trap -- " + shlex.quote(_DEBUG_TRAP) + " DEBUG"


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
    stderr: bytes | None = None  # only when asked for apart
    stderr_total: int = 0
    # The daemon killed the sandbox's processes, the shell's among them, for its disk cap.
    disk_cap_killed: bool = False


class _Relabeled:
    """A capped stream in which bash's label for the command file (`<file>: line 1: ...`) is
    written as the shell's name (`bash: line 1: ...`), as `bash -c` would. The last `hold` bytes
    wait for the next chunk while they could be the start of a label."""

    def __init__(self, hold: int, label: bytes, name: bytes, limit: int, pending: bytes = b"") -> None:
        self.hold = hold
        self.label = label
        self.name = name
        self.buffer = HeadTailBuffer(limit)
        self.pending = bytearray(pending)

    def write(self, data: bytes) -> None:
        self.pending += data
        self._release(len(self.pending) - self.hold)

    def _release(self, cut: int) -> None:
        """Passes on what comes before `cut`, less a label that starts before it and ends after."""
        if cut <= 0:
            return
        label_at = self.pending.find(self.label, max(0, cut - len(self.label) + 1))
        if 0 <= label_at < cut:
            cut = label_at
        self._emit(bytes(self.pending[:cut]))
        del self.pending[:cut]

    def _emit(self, data: bytes) -> None:
        self.buffer.write(data.replace(self.label, self.name) if self.label in data else data)

    def flush(self) -> None:
        """Passes on what is still held back (the end of the stream)."""
        self._emit(bytes(self.pending))
        del self.pending[:]


class _Turn(_Relabeled):
    """Collects one command's terminal output until its end marker shows up."""

    def __init__(self, nonce: bytes, hold: int, label: bytes, name: bytes, limit: int, stray: bytes) -> None:
        super().__init__(hold, label, name, limit, stray)  # hold: also a marker's start
        self.nonce = nonce
        self.done: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
        self.last_output = time.monotonic()

    def on_output(self, data: bytes) -> bytes:
        """Takes the terminal's next bytes; returns those that come after this turn's marker (the
        output of background jobs, which belongs to the next turn): all of `data` once it ended."""
        self.last_output = time.monotonic()
        if self.done.done():
            return data
        self.pending += data
        match = _MARKER.search(self.pending)
        while match and match.group(1) != self.nonce:  # one the command printed itself: output
            match = _MARKER.search(self.pending, match.end())
        if match:
            result = (int(match.group(2)), match.group(3).decode())  # before the buffer changes under it
            self._emit(bytes(self.pending[: match.start()]))
            after = bytes(self.pending[match.end() :])
            del self.pending[:]
            self.done.set_result(result)
            return after
        self._release(len(self.pending) - self.hold)
        return b""


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
        user: str = "",
    ) -> None:
        self.runtime = runtime
        self.user = user  # who the shell runs as, restarts included ("": the sandbox's default)
        self.name = name
        self.env = env
        self.cwd = cwd
        self.size = (rows, cols)
        self.program = program
        self._bash = os.path.basename(program) == "bash"
        self.turns = 0
        self.restarts = 0
        self._cmd_host = Path(runtime.run_dir_host) / f"sh{slot}.cmd"
        self._cmd_sandbox = f"{runtime.run_dir_sandbox}/sh{slot}.cmd"
        self._err_host = Path(runtime.run_dir_host) / f"sh{slot}.err"
        self._err_sandbox = f"{runtime.run_dir_sandbox}/sh{slot}.err"
        self._err_ends: tuple[int, int] | None = None  # the stderr fifo's read end and spare write end
        self._err_turn: _Relabeled | None = None  # where stderr goes while a turn wants it apart
        self._err_stray = bytearray()
        self._pager_host = Path(runtime.run_dir_host) / "pager"
        self._pager_sandbox = f"{runtime.run_dir_sandbox}/pager"
        # bash labels errors in the sourced file with its path (`bash -c`: with the shell's name),
        # and the path is what BASH_SOURCE, `caller` or `declare -F` say of the command: the
        # daemon writes the shell's name wherever the path shows.
        self._label = self._cmd_sandbox.encode()
        self._shell_name = os.path.basename(program).encode()
        self._terminal: Terminal | None = None
        self._commands: int | None = None  # the write end of the shell's command pipe
        self._cmd_fd: int | None = None
        self._cmd_size = 0  # the command file's size: it is truncated only when a command is shorter
        self._turn: _Turn | None = None
        self._stray = bytearray()
        self._options = ""  # the user's options the last turn line switched off (see _OPTION_ON)
        self._pagers: tuple[str, ...] = ()  # the pagers the image has: run as the pager script
        self._shell_cmdline = b""
        self._lock = asyncio.Lock()
        self.closed = False

    @property
    def pid(self) -> int:
        return self._terminal.pid if self._terminal else 0

    # -- the protocol ------------------------------------------------------------------------------

    def _turn_line(self, nonce: str, separate_stderr: bool = False) -> bytes:
        """The line the shell reads for one turn: source the command with the terminal as its
        stdin, stdout and stderr, then print the end marker. The whole line runs with stdout and
        stderr to /dev/null, so nothing the user set up to echo what the shell runs (`set -x`
        with any PS4, a DEBUG trap) shows the line's own commands; the command itself gets the
        terminal back (a DEBUG trap runs before a command's own redirections, on the line's)."""
        if not self._bash:
            # Plain sh: the same marker, printed with printf (no `trap -p` in POSIX sh), and an
            # interrupt stops the current command only (no DEBUG trap to unwind with).
            return (
                f"__corral_rc=0; trap : INT; . '{self._cmd_sandbox}' </dev/tty {self._stderr_to(separate_stderr)} "
                "|| __corral_rc=$?; "
                f'printf "trap -- \'__CORRAL_%s_%s_\' {MARKER_SIGNAL}\\n" {nonce} "$__corral_rc" >/dev/tty\n'
            ).encode()
        prologue = "__corral_rc=0; [[ -o posix ]] && __corral_pm=1 || __corral_pm=; "
        # `less` and `more`, where the image has them, are the pager script: entries of bash's
        # command table, put back whenever PATH changed (which empties it), by plain assignments:
        # no builtin that a function could shadow may run in the turn line.
        if self._pagers:
            prologue += (
                '[[ $PATH == "$__corral_path" ]] || { '
                + "".join(f"BASH_CMDS[{pager}]={self._pager_sandbox}; " for pager in self._pagers)
                + "__corral_path=$PATH; }; "
            )
        # The user's xtrace, verbose and history options, off since the last turn's end, back on
        # for the command: this line was read with them off (so it is neither echoed nor kept in
        # history, and its `!` is no history expansion). `set` in POSIX mode, where special
        # builtins outrank functions.
        if self._options:
            prologue += (
                "POSIXLY_CORRECT=y; \\set "
                + " ".join(_OPTION_ON[option] for option in self._options)
                + "; [[ $__corral_pm ]] || \\unset POSIXLY_CORRECT; "
            )
        stderr = self._stderr_to(separate_stderr) or "2>&0"
        source = f"\\. '{self._cmd_sandbox}' <>/dev/tty >&0 {stderr} || __corral_rc=$?; "
        # POSIX mode for the end, then back to the user's: the DEBUG trap of an interrupt switched
        # it on, a command may have itself. The options the prologue turns back on are reported in
        # the marker and switched off before the next line is read.
        epilogue = (
            "__corral_end=${__corral_abort:+130} __corral_abort=; "
            "[[ -o posix && ( -z $__corral_end || $__corral_pm ) ]] && __corral_pm=1 || { __corral_pm=; POSIXLY_CORRECT=y; }; "
            "[[ $__corral_end ]] && \\trap - DEBUG; "
            "__corral_o=${-//[!xv]/}; [[ :$SHELLOPTS: == *:history:* ]] && __corral_o+=h; "
            f'\\trap -- "__CORRAL_{nonce}_${{__corral_end:-$__corral_rc}}_$__corral_o" {MARKER_SIGNAL}; '
            f"\\trap -p {MARKER_SIGNAL} >/dev/tty; \\trap - {MARKER_SIGNAL}; \\set +xv +o history; "
            "[[ $__corral_pm ]] || \\unset POSIXLY_CORRECT; "
        )
        return ("{ " + prologue + source + epilogue + "} >/dev/null 2>&1\n").encode()

    def _stderr_to(self, separate: bool) -> str:
        # A fifo the daemon reads as it fills, like the terminal: a flood costs no disk, and
        # blocks the writer once the daemon stops keeping up, as a terminal would.
        return f"2>'{self._err_sandbox}'" if separate else ""

    def _setup_line(self) -> bytes:
        """Sent once when the shell starts: no job control; for bash, the abort signal's trap, set
        in POSIX mode."""
        if not self._bash:
            return b"set +m\n"
        return (
            "set +m; POSIXLY_CORRECT=y; \\trap -- "
            + shlex.quote(_ABORT_TRAP)
            + f" {ABORT_SIGNAL}; \\unset POSIXLY_CORRECT\n"
        ).encode()

    def _command_text(self, command: str) -> bytes:
        return (command if command.endswith("\n") else command + "\n").encode("utf-8", "surrogateescape")

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._bash and not self._pager_host.exists():
            _write_private(self._pager_host, _PAGER_SCRIPT, 0o755)
        commands, feed = os.pipe()
        os.set_blocking(feed, False)
        flags = " --noprofile --norc" if self._bash else ""
        # The command pipe comes in as stderr (the terminal must be stdin for `setsid --ctty`);
        # inside the sandbox it becomes the shell's stdin, and stderr the terminal again, which
        # stays the controlling terminal and stdout, and which commands get back as stdin.
        launch = f"exec {shlex.quote(self.program)}{flags} 0<&2 2>&1"
        argv = ["/bin/sh", "-c", launch]
        enter = self.runtime.enter_command(
            argv, cwd=self.cwd, leaf=self.runtime.next_leaf("sh"), env=self.env, user=self.user
        )
        try:
            terminal = Terminal(
                enter.argv,
                env=enter.env,
                cwd=enter.cwd,
                rows=self.size[0],
                cols=self.size[1],
                cgroup=enter.cgroup,
                wrapped=enter.wrapped,
                stderr=commands,
            )
        except BaseException:
            os.close(feed)
            raise
        finally:
            os.close(commands)
        self._terminal, self._commands = terminal, feed
        terminal.attach(self._on_output)
        self._options = ""
        self._pagers = ()
        # The setup turn says which pagers the image has (before any command of the user's could
        # have defined a function named `command`).
        self._write_command(self._command_text("command -v less more" if self._bash else ":"))
        nonce = secrets.token_hex(8)
        turn = self._new_turn(nonce, 1 << 16)
        self._turn = turn
        try:
            await self._send(self._setup_line() + self._turn_line(nonce))
            await asyncio.wait_for(self._wait_turn_or_exit(turn, terminal), START_TIMEOUT_S)
        except TimeoutError:
            await self._release()
            raise RuntimeError(f"the shell did not start within {START_TIMEOUT_S:g}s") from None
        finally:
            if self._terminal is terminal and not turn.done.done():
                terminal.drain(terminal.master, self._on_output, DRAIN_LIMIT)  # what it said before exiting
            self._turn = None
        if terminal.exited.done():
            turn.flush()
            said = turn.buffer.getvalue().decode(errors="replace").strip()[-500:]
            raise RuntimeError(
                f"the shell exited at once (exit {terminal.exited.result()})" + (f": {said}" if said else "")
            )
        found = turn.buffer.getvalue().split()
        self._pagers = tuple(name for name in ("less", "more") if any(p.endswith(b"/" + name.encode()) for p in found))
        self._shell_cmdline = self._cmdline()

    def _new_turn(self, nonce: str, limit: int, stray: bytes = b"") -> _Turn:
        # Held back: enough for a marker's start (`trap -- '__CORRAL_` + the nonce + an exit code)
        # or a label, whichever is longer.
        hold = max(len(self._label), 64)
        return _Turn(nonce.encode(), hold, self._label, self._shell_name, limit, stray)

    async def _send(self, data: bytes) -> None:
        """Writes to the shell's command pipe; TimeoutError when the shell has not read for a while."""
        assert self._commands is not None
        await write_all(self._commands, data, timeout=10.0)

    def _write_command(self, data: bytes) -> None:
        # Overwrite in place and truncate after: opening with O_TRUNC costs ~0.1-0.3 ms a turn on
        # ext4, most of the daemon's own time in a turn; this costs a few microseconds.
        if self._cmd_fd is None:
            self._cmd_fd = create_private_file(self._cmd_host, 0o644)
            self._cmd_size = 0
        view = memoryview(data)
        offset = 0
        while offset < len(data):
            offset += os.pwrite(self._cmd_fd, view[offset:], offset)
        if len(data) < self._cmd_size:
            os.ftruncate(self._cmd_fd, len(data))
        self._cmd_size = len(data)

    async def close(self) -> None:
        """Ends the session for good (a running turn fails with FAILED_PRECONDITION)."""
        self.closed = True
        await self._release()

    async def _release(self) -> None:
        if self._terminal:
            await self._terminal.close()
            self._terminal = None
        if self._commands is not None:
            os.close(self._commands)
            self._commands = None
        if self._cmd_fd is not None:
            os.close(self._cmd_fd)
            self._cmd_fd = None
        if self._err_ends is not None:
            asyncio.get_running_loop().remove_reader(self._err_ends[0])
            for fd in self._err_ends:
                os.close(fd)
            self._err_ends = None
            self._err_host.unlink(missing_ok=True)
        self._cmd_host.unlink(missing_ok=True)

    async def _restart(self) -> None:
        await self._release()
        self.restarts += 1
        self._stray.clear()
        self._err_stray.clear()
        await self.start()

    # -- output routing ------------------------------------------------------------------------------

    def _on_output(self, data: bytes) -> None:
        # What comes after a turn's marker (in the same read, or before the turn is put away) was
        # written after the turn ended: background output between turns, for the next one.
        if self._turn:
            data = self._turn.on_output(data)
        if data and len(self._stray) < STRAY_LIMIT:
            self._stray += data[: STRAY_LIMIT - len(self._stray)]

    def _open_stderr(self) -> None:
        if self._err_ends is None:
            self._err_ends = create_private_fifo(self._err_host, 0o666)  # the sandbox's user writes it
            asyncio.get_running_loop().add_reader(self._err_ends[0], self._on_stderr)

    def _on_stderr(self) -> None:
        """Reads the stderr fifo. Its writers live on after their turn (background jobs): what
        they write while no turn takes stderr apart goes to the next turn (apart, or before its
        terminal output)."""
        assert self._err_ends is not None
        for _ in range(32):  # enough for the largest pipe a writer can ask for (1 MiB); then yield
            try:
                data = os.read(self._err_ends[0], 1 << 16)
            except BlockingIOError:
                return
            if self._err_turn is not None:
                self._err_turn.write(data)
            elif len(self._err_stray) < STRAY_LIMIT:
                self._err_stray += data[: STRAY_LIMIT - len(self._err_stray)]
            if len(data) < 1 << 16:
                return

    def _cmdline(self) -> bytes:
        pid = self._terminal.shell_pid() if self._terminal else None
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes() if pid else b""
        except OSError:
            return b""

    # -- a turn --------------------------------------------------------------------------------------

    async def run(
        self,
        command: str,
        *,
        timeout_s: float,
        idle_timeout_s: float,
        output_limit: int,
        strip: bool,
        separate_stderr: bool = False,
    ) -> tuple[TurnResult, bytes | None]:
        async with self._lock:
            result = await self._run_locked(command, timeout_s, idle_timeout_s, output_limit, separate_stderr)
        return result, (strip_ansi(result.output) if strip else None)

    async def _run_locked(
        self, command: str, timeout_s: float, idle_timeout_s: float, limit: int, separate_stderr: bool
    ) -> TurnResult:
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
        disk_kills = self.runtime.disk_kills()
        terminal.reset()
        self._write_command(self._command_text(command))
        stderr = None
        if separate_stderr:
            self._open_stderr()
            stderr = _Relabeled(len(self._label) - 1, self._label, self._shell_name, limit, bytes(self._err_stray))
        else:
            self._stray += self._err_stray
        self._err_stray.clear()
        nonce = secrets.token_hex(8)
        turn = self._new_turn(nonce, limit, bytes(self._stray))
        self._stray.clear()
        # What this turn starts has a larger pid than any process before it (pids are handed out in
        # increasing order; after a wrap-around, the turn's processes are taken for older ones,
        # which spares them): one small read instead of listing the session's processes.
        before = _last_pid()
        self._turn, self._err_turn = turn, stderr
        self.turns += 1
        timed_out, reason = False, ""
        try:
            try:
                await self._send(self._turn_line(nonce, separate_stderr))
            except TimeoutError:  # the shell has not read its input for seconds: beyond saving
                outcome = "stuck"
            else:
                outcome = await self._wait(turn, terminal, started + timeout_s, idle_timeout_s)
            if outcome in ("timeout", "idle_timeout"):
                timed_out, reason = True, outcome
                outcome = await self._interrupt(turn, terminal, before)
        finally:
            if not turn.done.done() and self._terminal is terminal:  # (not closed meanwhile)
                # The shell exited (or was replaced, or is stuck) without a marker: what it and its
                # commands wrote before is in the terminal, maybe not yet delivered to its reader
                # (the kernel hands a pty's output over from a worker, late under load); a read
                # waits for that hand-over, so draining now takes every byte written before the end.
                terminal.drain(terminal.master, self._on_output, DRAIN_LIMIT)
            if self._err_ends is not None:
                self._on_stderr()  # what the command wrote before its end is in the fifo by now
            self._turn = self._err_turn = None
        turn.flush()
        if stderr is not None:
            stderr.flush()
        if self.closed:
            raise FailedPrecondition(f"shell {self.name!r} was closed while the command ran")
        if outcome == "done":
            exit_code, self._options = turn.done.result()
            if timed_out:
                await asyncio.to_thread(_kill_leftovers, terminal, before)
        else:
            exit_code = terminal.exited.result() if terminal.exited.done() else 137
            await self._restart()  # the shell died, was replaced, or could not be brought back
            restarted = True
        output = _captured(turn.buffer)
        return TurnResult(
            output=output,
            exit_code=exit_code,
            timed_out=timed_out,
            timeout_reason=reason,
            truncated=turn.buffer.truncated or bool(stderr and stderr.buffer.truncated),
            output_total=turn.buffer.total,
            duration_ms=int((time.monotonic() - started) * 1000),
            shell_restarted=restarted,
            stderr=None if stderr is None else _captured(stderr.buffer),
            stderr_total=0 if stderr is None else stderr.buffer.total,
            disk_cap_killed=exit_code >= 128 and self.runtime.disk_kills() > disk_kills,
        )

    async def _wait_turn_or_exit(self, turn: _Turn, terminal: Terminal) -> str:
        await _first_of(turn.done, terminal.exited)
        return "done" if turn.done.done() else "exited"

    async def _wait(self, turn: _Turn, terminal: Terminal, deadline: float, idle_timeout_s: float) -> str:
        """Waits for the marker; returns "done", "exited", "replaced", "timeout" or "idle_timeout"."""
        while True:
            now = time.monotonic()
            wake = deadline
            if idle_timeout_s:
                wake = min(wake, turn.last_output + idle_timeout_s)
            wake = min(wake, now + EXEC_POLL_S)  # also look for an exec'd shell now and then
            await _first_of(turn.done, terminal.exited, timeout=max(0.0, wake - now))
            if turn.done.done():
                return "done"
            if terminal.exited.done():
                return "exited"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            if idle_timeout_s and now - turn.last_output >= idle_timeout_s:
                return "idle_timeout"
            cmdline = self._cmdline()
            if cmdline != self._shell_cmdline:
                if not cmdline:
                    # The shell is exiting (a zombie, or reaped by a wrapper that has not exited
                    # yet): its exit, with its code, is a moment away.
                    continue
                # The command exec'd another program in the shell's place (`exec bash`, `exec
                # python`): it reads the terminal, not the command pipe, so the session cannot go
                # on with it. What it printed until now is the turn's output.
                return "replaced"

    async def _interrupt(self, turn: _Turn, terminal: Terminal, before: int) -> str:
        """Arms the shell's abort (bash: the reserved signal, whose trap makes the rest of the
        command unwind once its foreground is gone; sh: SIGINT, which its trap only survives) and
        sends SIGINT to what the turn started, then end-of-file on the terminal, then SIGKILL to
        what the turn started; "done" once the shell prints the marker, else "exited"/"stuck"."""
        shell = terminal.shell_pid()

        def started_by_turn() -> set[int]:
            pids = terminal.inner_pids() - {shell or 0}
            return {pid for pid in pids if pid > before}

        async def interrupt() -> None:
            if shell:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(shell, ABORT_SIGNUM if self._bash else signal.SIGINT)
            _signal(started_by_turn(), signal.SIGINT)

        async def end_of_file() -> None:
            with contextlib.suppress(TimeoutError):
                await terminal.write(b"\x04", timeout=GRACE_S)

        async def kill() -> None:
            _signal(started_by_turn(), signal.SIGKILL)

        for step in (interrupt, end_of_file, kill):
            await step()
            try:
                return await asyncio.wait_for(self._wait_turn_or_exit(turn, terminal), GRACE_S)
            except TimeoutError:
                continue
        return "stuck"


async def _first_of(*futures: asyncio.Future, timeout: float | None = None) -> None:
    """Returns once one of `futures` is done or after `timeout`. asyncio.wait does the same at
    several times the cost, which a turn pays at least once."""
    if any(future.done() for future in futures):
        return
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(timeout, wake) if timeout is not None else None
    for future in futures:
        future.add_done_callback(wake)
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()
        for future in futures:
            future.remove_done_callback(wake)


def _captured(buffer: HeadTailBuffer) -> bytes:
    return utf8_safe(buffer) if buffer.truncated else buffer.getvalue()


def _write_private(path: Path, data: bytes, mode: int) -> None:
    fd = create_private_file(path, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _parent(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


class _LastPid:
    """The pid last handed out in this pid namespace, read through one fd kept open (a read costs
    a microsecond or two; opening the file each turn would cost ten)."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def __call__(self) -> int:
        if self._fd is None:
            return 0
        try:
            return int(os.pread(self._fd, 32, 0))
        except (OSError, ValueError):
            return 0


_last_pid = _LastPid()


def _kill_leftovers(terminal: Terminal, before: int) -> None:
    """After a timed-out turn has ended: kills every process it started, except the background
    jobs it left at the shell's top level (the shell's own children now: its foreground is gone)
    and what those started. Processes of earlier turns are not touched."""
    shell = terminal.shell_pid()
    if not shell:
        return
    started = {pid for pid in terminal.inner_pids() if pid > before} - {shell}
    parents = {pid: _parent(pid) for pid in started}
    jobs = {pid for pid, parent in parents.items() if parent == shell}

    def in_a_job(pid: int) -> bool:
        seen = set()
        while pid and pid not in seen:
            if pid in jobs:
                return True
            seen.add(pid)
            pid = parents.get(pid) or _parent(pid)
            if pid == shell:
                return False
        return False

    _signal({pid for pid in started if not in_a_job(pid)}, signal.SIGKILL)
