"""The events of one kernel cell, decoded from Jupyter messages, the caps on what a cell (or the
output that arrives between cells) may make the daemon hold, and a cell gathered whole."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .kernel_bootstrap import bound_error, bound_result, is_text_mime
from .output import HeadTailBuffer, utf8_safe

# Display data (display_data outputs) one cell may make the daemon hold, forward or gather; past
# it, displays are dropped whole and counted. Stream text has the daemon's output cap instead. A
# cell's value is bounded by both: its text values by the output cap, all of it by this.
DISPLAY_LIMIT_BYTES = 16 << 20

# -- events of one cell ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamOutput:
    name: str  # "stdout" | "stderr"
    text: str
    # Bytes the kernel dropped before this text (its output governor keeps a long stream's head
    # and tail only: see kernel_bootstrap); the text is then the stream's tail.
    skipped: int = 0


@dataclass(frozen=True)
class DisplayOutput:
    data: dict[str, bytes]  # MIME type -> UTF-8 text or decoded binary
    dropped: bool = False  # too large on its own: the kernel sent it without its data


@dataclass(frozen=True)
class ResultOutput:
    """The cell's value, cut to the caps inside the kernel (see kernel_bootstrap.bound_result)."""

    data: dict[str, bytes]
    truncated: bool = False
    total_bytes: int = 0  # of all its data before the cut


@dataclass(frozen=True)
class ErrorOutput:
    ename: str
    evalue: str
    traceback: list[str]
    # The message or the traceback was cut to the output cap (kernel_bootstrap.bound_error).
    truncated: bool = False
    total_bytes: int = 0  # of its name, message and traceback before the cut


@dataclass(frozen=True)
class CellDone:
    execution_count: int  # 0: the cell did not run (the kernel had died before it)
    failed: bool
    timed_out: bool
    kernel_died: bool
    duration_ms: int
    # Why the kernel died (kernel_died): its exit code (128 + signal) and signal.
    exit_code: int = 0
    signal: int = 0
    # The sandbox's OOM kill count rose during the cell (or since the previous one, if it did not run).
    oom_killed: bool = False
    # Output past the caps was dropped: streamed, past the cap; gathered, the middle (see gather);
    # or the cell's value or error was cut.
    truncated: bool = False
    stdout_total_bytes: int = 0
    stderr_total_bytes: int = 0
    displays_dropped: int = 0
    # The kernel was dead when the cell came and was restarted for it (its state is gone), and
    # why it had died, in words.
    restarted: bool = False
    restart_reason: str = ""


@dataclass(frozen=True)
class LateOutput:
    """Output of earlier cells that arrived after their results: delivered before the next cell's
    own events (see LateBuffer)."""

    stdout: str = ""
    stderr: str = ""
    displays: list[DisplayOutput | ResultOutput] = field(default_factory=list)  # display_data and execute_result
    errors: list[ErrorOutput] = field(default_factory=list)
    # Text past the cap, displays and errors dropped, or a value or error that was cut.
    truncated: bool = False
    stdout_total_bytes: int = 0
    stderr_total_bytes: int = 0
    dropped: int = 0  # displays and errors dropped whole


KernelEvent = StreamOutput | DisplayOutput | ResultOutput | ErrorOutput | CellDone | LateOutput


# -- jupyter message content -> events ---------------------------------------------------------------


def mime_bytes(mime: str, value: object) -> bytes:
    """One value of a Jupyter MIME bundle as the bytes the contract promises: JSON values arrive
    parsed, text types are UTF-8, binary types arrive base64-encoded and leave decoded."""
    if not isinstance(value, str):
        return json.dumps(value).encode()
    if is_text_mime(mime):
        return value.encode()
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        return value.encode()  # an unknown type that was not base64 after all


def mime_bundle(data: dict) -> dict[str, bytes]:
    return {mime: mime_bytes(mime, value) for mime, value in data.items()}


def output_event(msg: dict, limit: int) -> KernelEvent | None:
    """The event an iopub message carries for the caller, if any. A result or an error is cut to
    the bounds the kernel applies (`limit`: the output cap) in case the kernel did not."""
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        skipped = content.get("corral_skipped", 0)
        skipped = skipped if isinstance(skipped, int) and skipped > 0 else 0
        return StreamOutput(content.get("name", "stdout"), content.get("text", ""), skipped)
    if kind in ("display_data", "update_display_data"):
        return DisplayOutput(mime_bundle(content.get("data", {})), dropped=content.get("corral_dropped") is True)
    if kind == "execute_result":
        data, truncated, total = bound_result(content.get("data", {}), limit, DISPLAY_LIMIT_BYTES)
        truncated, total = _kernel_cut(content, truncated, total)
        return ResultOutput(mime_bundle(data), truncated, total)
    if kind == "error":
        return error_event(content, limit)
    return None


def error_event(content: dict, limit: int) -> ErrorOutput:
    ename = str(content.get("ename", ""))
    evalue, traceback, truncated, total = bound_error(
        ename, str(content.get("evalue", "")), [str(line) for line in content.get("traceback", [])], limit
    )
    truncated, total = _kernel_cut(content, truncated, total)
    return ErrorOutput(ename, evalue, traceback, truncated, total)


def _kernel_cut(content: dict, truncated: bool, total: int) -> tuple[bool, int]:
    """(truncated, total) of a result or error, with what the kernel said of its own cut."""
    reported = content.get("corral_total_bytes")
    if isinstance(reported, int) and not isinstance(reported, bool):
        total = max(total, reported)
    return truncated or content.get("corral_truncated") is True, total


# -- caps ----------------------------------------------------------------------------------------------


def text_bytes(text: str) -> bytes:
    """Stream text as the UTF-8 bytes the caps and totals count (a lone surrogate counts as '?')."""
    return text.encode(errors="replace")


def rich_size(event: DisplayOutput | ResultOutput | ErrorOutput) -> int:
    """The bytes a rich output holds, as caps count them."""
    if isinstance(event, ErrorOutput):
        return len(text_bytes(event.ename + event.evalue + "".join(event.traceback)))
    return sum(len(value) for value in event.data.values())


def _text(buffer: HeadTailBuffer) -> str:
    return utf8_safe(buffer).decode(errors="replace")


class StreamCap:
    """What a cell may send: each stream's text up to `limit` UTF-8 bytes (cut at a character
    boundary; None: no cap, for a gathered cell, which keeps head and tail instead), display data up
    to DISPLAY_LIMIT_BYTES (past it displays are dropped whole). Applied as the messages arrive,
    so a slow reader of a streamed cell never makes the daemon hold more than that; counts
    everything, kept or not."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.totals = {"stdout": 0, "stderr": 0}
        self.display_bytes = 0
        self.displays_dropped = 0
        self.text_dropped = False
        self.rich_cut = False  # the cell's value or error was cut

    def admit(self, event: KernelEvent) -> KernelEvent | None:
        """The event as forwarded (text perhaps cut), or None when dropped."""
        if isinstance(event, StreamOutput):
            name = "stderr" if event.name == "stderr" else "stdout"
            data = text_bytes(event.text)
            if event.skipped:
                self.text_dropped = True
                self.totals[name] += event.skipped
            room = None if self.limit is None else self.limit - self.totals[name]
            self.totals[name] += len(data)
            if room is None or len(data) <= room:
                return event
            self.text_dropped = True
            kept = data[: max(room, 0)].decode(errors="ignore")  # a cut character goes whole
            return StreamOutput(event.name, kept) if kept else None
        if isinstance(event, DisplayOutput):
            size = rich_size(event)
            if event.dropped or self.display_bytes + size > DISPLAY_LIMIT_BYTES:
                self.displays_dropped += 1
                return None
            self.display_bytes += size
        elif isinstance(event, ResultOutput | ErrorOutput):
            self.rich_cut = self.rich_cut or event.truncated
        return event

    def count_totals(self, reported: object) -> None:
        """The kernel's own count of what each stream printed (the execute reply's
        `corral_output`): exact even when messages were lost on the way (iopub drops what a slow
        reader leaves behind), so it wins when larger; output lost that way is truncation."""
        if not isinstance(reported, dict):
            return
        for name in self.totals:
            total = reported.get(name)
            if isinstance(total, int) and total > self.totals[name]:
                self.totals[name] = total
                self.text_dropped = True

    @property
    def truncated(self) -> bool:
        return self.text_dropped or self.displays_dropped > 0 or self.rich_cut


class LateBuffer:
    """Output that arrives while no request waits for it (output of earlier cells), kept until
    the next cell: each stream's first and last halves of `limit` bytes, displays and errors up to
    `limit` bytes together (past it they are dropped whole), everything counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._reset()

    def _reset(self) -> None:
        self._streams = {"stdout": HeadTailBuffer(self.limit), "stderr": HeadTailBuffer(self.limit)}
        self._displays: list[DisplayOutput | ResultOutput] = []
        self._errors: list[ErrorOutput] = []
        self._rich_bytes = 0
        self._dropped = 0

    def add(self, event: KernelEvent) -> None:
        if isinstance(event, StreamOutput):
            stream = self._streams["stderr" if event.name == "stderr" else "stdout"]
            stream.skip(event.skipped)
            stream.write(text_bytes(event.text))
        elif isinstance(event, DisplayOutput | ResultOutput | ErrorOutput):
            size = rich_size(event)
            if (isinstance(event, DisplayOutput) and event.dropped) or self._rich_bytes + size > self.limit:
                self._dropped += 1
                return
            self._rich_bytes += size
            if isinstance(event, ErrorOutput):
                self._errors.append(event)
            else:
                self._displays.append(event)

    def __bool__(self) -> bool:
        return bool(self._displays or self._errors or self._dropped or any(b.total for b in self._streams.values()))

    def take(self) -> LateOutput | None:
        """What arrived since the last take (None if nothing), and empties the buffer."""
        if not self:
            return None
        out, err = self._streams["stdout"], self._streams["stderr"]
        late = LateOutput(
            _text(out),
            _text(err),
            self._displays,
            self._errors,
            out.truncated
            or err.truncated
            or self._dropped > 0
            or any(isinstance(r, ResultOutput) and r.truncated for r in self._displays)
            or any(e.truncated for e in self._errors),
            out.total,
            err.total,
            self._dropped,
        )
        self._reset()
        return late


# -- a whole cell ---------------------------------------------------------------------------------------


@dataclass
class GatheredCell:
    stdout: str = ""
    stderr: str = ""
    result: ResultOutput | None = None
    displays: list[DisplayOutput] = field(default_factory=list)
    error: ErrorOutput | None = None
    done: CellDone | None = None
    truncated: bool = False
    late: LateOutput | None = None


async def gather(events: AsyncIterator[KernelEvent], limit: int) -> GatheredCell:
    """Collects a cell's events; stdout and stderr keep their first and last `limit // 2` bytes
    each (cut at character boundaries), so a cell that prints gigabytes cannot exhaust the daemon.
    The events come uncut (StreamCap without a limit): the done's totals count everything, and
    its `truncated` becomes the gathered cell's."""
    cell = GatheredCell()
    streams = {"stdout": HeadTailBuffer(limit), "stderr": HeadTailBuffer(limit)}
    async for event in events:
        if isinstance(event, StreamOutput):
            stream = streams["stderr" if event.name == "stderr" else "stdout"]
            stream.skip(event.skipped)
            stream.write(text_bytes(event.text))
        elif isinstance(event, DisplayOutput):
            cell.displays.append(event)
        elif isinstance(event, ResultOutput):
            cell.result = event
        elif isinstance(event, ErrorOutput):
            cell.error = event
        elif isinstance(event, LateOutput):
            cell.late = event
        elif isinstance(event, CellDone):
            cell.done = event
    cell.stdout = _text(streams["stdout"])
    cell.stderr = _text(streams["stderr"])
    lost = cell.done is not None and (
        cell.done.stdout_total_bytes > streams["stdout"].total or cell.done.stderr_total_bytes > streams["stderr"].total
    )  # the kernel counted more than arrived (see StreamCap.count_totals)
    cell.truncated = (
        any(b.truncated for b in streams.values())
        or lost
        or bool(cell.done and cell.done.displays_dropped)
        or bool(cell.result and cell.result.truncated)
        or bool(cell.error and cell.error.truncated)
    )
    if cell.done is not None:
        cell.done = dataclasses.replace(cell.done, truncated=cell.truncated)
    return cell
