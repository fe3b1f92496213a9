"""What the asyncio and blocking background-process handles share: requests, decoding of replies,
the pattern matching of `expect`, and the plain-text screen of a terminal. No I/O here."""

from __future__ import annotations

import codecs
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from corral.sdk import _core
from corral.sdk.ansi import strip_ansi
from corral.sdk.errors import CorralError, InvalidArgument
from corral.v1 import shell_pb2 as shell_pb

# Seconds one WaitProcess or ReadProcessOutput call waits on the daemon side; longer waits are
# several calls, so that no call outlives a deadline the transport would give it.
WAIT_SLICE_S = 30.0
# A call's deadline beyond how long the daemon is asked to wait.
WAIT_MARGIN_S = 15.0
# Text kept for `expect` that no pattern has consumed yet (characters); older text is dropped.
EXPECT_WINDOW_CHARS = 1 << 20


@dataclass(frozen=True)
class ProcessInfo:
    """A background process as the daemon last described it."""

    sandbox_id: str
    id: str
    argv: list[str]
    # The daemon-side process id, for diagnostics.
    pid: int
    running: bool
    # Its exit status once ended (128 + n after signal n); 0 while it runs.
    exit_code: int
    # Bytes it has written so far, and the offset of the oldest byte the daemon still keeps.
    output_end: int
    output_start: int


@dataclass(frozen=True)
class ProcessOutput:
    """One read: `data` starts at `offset`; `dropped_bytes` were lost before it (the daemon's ring
    buffer had moved past them); the next read continues at `next_offset`."""

    data: bytes
    offset: int
    dropped_bytes: int
    next_offset: int
    process: ProcessInfo


class ExpectFailed(CorralError):
    """`expect` found no match: the timeout passed (`ended` False) or the process ended first
    (`ended` True). `text` is what it saw and did not consume."""

    def __init__(self, message: str, *, text: str, ended: bool) -> None:
        super().__init__(message)
        self.text = text
        self.ended = ended


def build_start_process_request(
    sandbox_id: str,
    cmd: _core.Command,
    *,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    rows: int | None,
    cols: int | None,
    term: str | None,
    interactive: bool,
    buffer_size: int | None,
) -> shell_pb.StartProcessRequest:
    command = _core.build_command(cmd, stdin=None, env=env, cwd=cwd, timeout=None, output_limit=None, user=user)
    request = shell_pb.StartProcessRequest(
        sandbox_id=sandbox_id,
        argv=list(command.argv.args),
        shell=command.shell,
        env=dict(command.env),
        cwd=command.cwd,
        user=command.user,
        term=term or "",
        interactive=interactive,
        buffer_bytes=_core._non_negative("buffer_size", buffer_size),
    )
    size = _core._terminal_size(rows, cols)
    if size is not None:
        request.size.CopyFrom(size)
    return request


def process_info_from_proto(info: shell_pb.ProcessInfo) -> ProcessInfo:
    return ProcessInfo(
        sandbox_id=info.sandbox_id,
        id=info.process_id,
        argv=list(info.argv),
        pid=info.pid,
        running=info.running,
        exit_code=info.exit_code,
        output_end=info.output_end,
        output_start=info.output_start,
    )


def process_output_from_proto(response: shell_pb.ReadProcessOutputResponse) -> ProcessOutput:
    return ProcessOutput(
        data=response.data,
        offset=response.offset,
        dropped_bytes=response.dropped_bytes,
        next_offset=response.next_offset,
        process=process_info_from_proto(response.process),
    )


def wait_ms(seconds: float | None) -> int:
    """A wait on the wire: at most one slice (0: do not wait)."""
    if seconds is None or seconds <= 0:
        return 0
    return max(1, round(min(seconds, WAIT_SLICE_S) * 1000))


def wait_deadline(seconds: float | None) -> float:
    return min(seconds or 0.0, WAIT_SLICE_S) + WAIT_MARGIN_S


Pattern = str | re.Pattern[str]


def compile_patterns(patterns: Pattern | Sequence[Pattern]) -> list[re.Pattern[str]]:
    """One pattern or several; a str is matched literally, a compiled regular expression as it is."""
    items = [patterns] if isinstance(patterns, (str, re.Pattern)) else list(patterns)
    if not items:
        raise InvalidArgument("expect needs at least one pattern")
    compiled = []
    for pattern in items:
        if isinstance(pattern, re.Pattern):
            compiled.append(pattern)
        elif isinstance(pattern, str) and pattern:
            compiled.append(re.compile(re.escape(pattern)))
        else:
            raise InvalidArgument(f"a pattern is a non-empty str or a compiled re.Pattern, got {pattern!r}")
    return compiled


class ExpectBuffer:
    """Decoded output not consumed by a match yet (UTF-8, undecodable bytes replaced)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def feed(self, data: bytes) -> None:
        self.text = (self.text + self._decoder.decode(data))[-EXPECT_WINDOW_CHARS:]

    def match(self, patterns: list[re.Pattern[str]]) -> re.Match[str] | None:
        """The match that ends first among `patterns` (the earlier pattern on a tie), with the
        text up to its end consumed."""
        found = [match for pattern in patterns if (match := pattern.search(self.text)) is not None]
        if not found:
            return None
        first = min(found, key=lambda match: match.end())
        self.text = self.text[first.end() :]
        return first


class Screen:
    """The text a terminal shows, kept as lines: ANSI escape sequences are dropped, carriage
    return goes back to the start of the line, backspace one cell back, and text overwrites what
    is under it, as on a terminal. Cursor moves, colours and scrolling regions are not modelled;
    for full-screen programs read the raw output instead."""

    def __init__(self, rows: int = 24) -> None:
        self.rows = rows
        self._lines: list[list[str]] = [[]]
        self._column = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = b""  # an escape sequence cut between two reads

    def feed(self, data: bytes) -> None:
        data = self._pending + data
        cut = data.rfind(b"\x1b")
        self._pending = b""
        if cut >= 0 and not _complete_escape(data[cut:]):
            data, self._pending = data[:cut], data[cut:]
        for char in self._decoder.decode(strip_ansi(data)):
            self._put(char)
        del self._lines[: -max(self.rows, 1)]

    def _put(self, char: str) -> None:
        line = self._lines[-1]
        if char == "\n":
            self._lines.append([])
            self._column = 0
        elif char == "\r":
            self._column = 0
        elif char == "\b":
            self._column = max(0, self._column - 1)
        elif char == "\t":
            self._column = (self._column // 8 + 1) * 8
        elif char >= " " or char == "\x7f":
            if char == "\x7f":
                return
            while len(line) < self._column:
                line.append(" ")
            if self._column < len(line):
                line[self._column] = char
            else:
                line.append(char)
            self._column += 1

    def text(self) -> str:
        """The last `rows` lines, trailing spaces removed."""
        return "\n".join("".join(line).rstrip() for line in self._lines)


def _complete_escape(tail: bytes) -> bool:
    """Whether `tail` (starting with ESC) holds a whole escape sequence."""
    return strip_ansi(tail) != tail or len(tail) > 256
