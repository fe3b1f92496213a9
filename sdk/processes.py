"""Background processes and terminals in a sandbox, asyncio: `AsyncProcess` (started with
`AsyncSandbox.start_process`) and `AsyncTerminal` (`AsyncSandbox.terminal`).

A process runs under a pty of its own while the caller does other things; the daemon keeps the
last part of its output in a ring buffer, which the handle reads from where it left off. The
blocking twins (`sync_processes.py`) are generated from this file by scripts/unasync.py: edit this
one, then run `make sync-client`.
"""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Sequence
from types import TracebackType

from corral.sdk import _core, _process_core
from corral.sdk._async_transport import AsyncTransport
from corral.sdk._process_core import ExpectBuffer, ExpectFailed, Pattern, ProcessInfo, ProcessOutput, Screen
from corral.sdk.errors import NotFound
from corral.v1 import shell_pb2 as shell_pb


class AsyncProcess:
    """A command running in a sandbox without anyone waiting for it. As an async context manager
    it closes the process (killing it if it still runs) on exit.

    `read` returns output from where the last read (or `expect`) ended; `dropped_bytes` counts
    what the daemon's ring buffer lost before this handle read it."""

    def __init__(self, transport: AsyncTransport, info: ProcessInfo) -> None:
        self._transport = transport
        self._info = info
        self._offset = 0
        self._expect = ExpectBuffer()
        self.dropped_bytes = 0

    @property
    def id(self) -> str:
        return self._info.id

    @property
    def info(self) -> ProcessInfo:
        """What the daemon last said about the process."""
        return self._info

    @property
    def offset(self) -> int:
        """Where the next read starts, in bytes of the process's whole output."""
        return self._offset

    async def read(self, *, wait: float | None = None, max_bytes: int | None = None) -> ProcessOutput:
        """The output since the last read. `wait`: seconds to wait, when there is none yet, for
        some (or for the process's end; None: answer at once; at most 30 s per call)."""
        request = shell_pb.ReadProcessOutputRequest(
            sandbox_id=self._info.sandbox_id,
            process_id=self.id,
            offset=self._offset,
            max_bytes=_core._non_negative("max_bytes", max_bytes),
            wait_ms=_process_core.wait_ms(wait),
        )
        response = await self._transport.unary(
            self._transport.shell_service.ReadProcessOutput, request, timeout=_process_core.wait_deadline(wait)
        )
        output = _process_core.process_output_from_proto(response)
        self._offset = output.next_offset
        self.dropped_bytes += output.dropped_bytes
        self._info = output.process
        self._expect.feed(output.data)
        return output

    async def expect(self, pattern: Pattern | Sequence[Pattern], *, timeout: float) -> re.Match[str]:
        """Reads until `pattern` (a str: literally; a compiled re.Pattern: as a regular expression;
        or a list of them, the first to match winning: `match.re` says which) appears in the
        output, decoded as UTF-8, and returns the match; the text up to its end is consumed, so
        the next `expect` looks after it. ExpectFailed when `timeout` seconds pass or the process
        ends first."""
        patterns = _process_core.compile_patterns(pattern)
        wanted = " or ".join(repr(p.pattern) for p in patterns)
        deadline = time.monotonic() + timeout
        while True:
            found = self._expect.match(patterns)
            if found is not None:
                return found
            left = deadline - time.monotonic()
            if not self._info.running and self._offset >= self._info.output_end:
                raise ExpectFailed(
                    f"process {self.id} ended (exit code {self._info.exit_code}) before {wanted} appeared",
                    text=self._expect.text,
                    ended=True,
                )
            if left <= 0:
                raise ExpectFailed(f"{wanted} did not appear within {timeout:g} s", text=self._expect.text, ended=False)
            await self.read(wait=left)

    async def write(self, data: bytes | str) -> None:
        """Types `data` on the process's terminal (a str as UTF-8). FailedPrecondition once the
        process has ended."""
        request = shell_pb.WriteProcessInputRequest(
            sandbox_id=self._info.sandbox_id,
            process_id=self.id,
            data=data.encode() if isinstance(data, str) else bytes(data),
        )
        await self._transport.unary(self._transport.shell_service.WriteProcessInput, request)

    async def send_signal(self, number: int) -> ProcessInfo:
        """Sends a signal to the process and everything it started (nothing once it has ended)."""
        request = shell_pb.SignalProcessRequest(sandbox_id=self._info.sandbox_id, process_id=self.id, signal=number)
        response = await self._transport.unary(self._transport.shell_service.SignalProcess, request)
        self._info = _process_core.process_info_from_proto(response.process)
        return self._info

    async def interrupt(self) -> ProcessInfo:
        """SIGINT to the process and everything it started, as ^C to all of them."""
        return await self.send_signal(signal.SIGINT)

    async def poll(self) -> ProcessInfo:
        """Asks the daemon whether it still runs, without waiting."""
        return await self.wait(0)

    async def wait(self, timeout: float | None = None) -> ProcessInfo:
        """Waits until the process ends or `timeout` seconds pass (None: until it ends) and
        returns it as it then is: `running` is True when the timeout came first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # Without a timeout each call waits a whole slice (a wait of 0 would answer at once,
            # and this loop would poll the daemon as fast as it answers).
            wait = _process_core.WAIT_SLICE_S if left is None else left
            request = shell_pb.WaitProcessRequest(
                sandbox_id=self._info.sandbox_id, process_id=self.id, timeout_ms=_process_core.wait_ms(wait)
            )
            response = await self._transport.unary(
                self._transport.shell_service.WaitProcess, request, timeout=_process_core.wait_deadline(wait)
            )
            self._info = _process_core.process_info_from_proto(response.process)
            if not self._info.running or (left is not None and left <= _process_core.WAIT_SLICE_S):
                return self._info

    async def close(self) -> None:
        """Kills the process if it still runs and forgets it on the daemon. Closing one that is
        already gone is not an error."""
        try:
            await self._transport.unary(
                self._transport.shell_service.CloseProcess,
                shell_pb.CloseProcessRequest(sandbox_id=self._info.sandbox_id, process_id=self.id),
            )
        except NotFound:
            pass

    async def __aenter__(self) -> AsyncProcess:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, argv={self._info.argv!r}, running={self._info.running})"


class AsyncTerminal(AsyncProcess):
    """An interactive program (a shell by default) on an ordinary terminal, driven by keys: what
    a person at the keyboard would see and type. `screen()` gives the terminal's text."""

    def __init__(self, transport: AsyncTransport, info: ProcessInfo, rows: int) -> None:
        super().__init__(transport, info)
        self._screen = Screen(rows)

    async def read(self, *, wait: float | None = None, max_bytes: int | None = None) -> ProcessOutput:
        output = await super().read(wait=wait, max_bytes=max_bytes)
        self._screen.feed(output.data)
        return output

    async def send_keys(self, keys: bytes | str) -> None:
        """Types keys: text, "\\r" for Enter, "\\x03" for ^C, "\\x04" for ^D, "\\x1b[A" for Up."""
        await self.write(keys)

    async def screen(self, *, wait: float | None = None) -> str:
        """The terminal's text (its last rows, escape sequences dropped) after reading what is
        there; `wait`: seconds to wait for new output when there is none yet."""
        await self.read(wait=wait)
        while self._offset < self._info.output_end:
            await self.read()
        return self._screen.text()


__all__ = ["AsyncProcess", "AsyncTerminal", "ExpectFailed", "ProcessInfo", "ProcessOutput"]
