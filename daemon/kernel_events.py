"""The events of one kernel cell, decoded from Jupyter messages, and a cell gathered whole."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .output import HeadTailBuffer

# -- events of one cell ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamOutput:
    name: str  # "stdout" | "stderr"
    text: str


@dataclass(frozen=True)
class DisplayOutput:
    data: dict[str, bytes]  # MIME type -> UTF-8 text or decoded binary


@dataclass(frozen=True)
class ResultOutput:
    data: dict[str, bytes]


@dataclass(frozen=True)
class ErrorOutput:
    ename: str
    evalue: str
    traceback: list[str]


@dataclass(frozen=True)
class CellDone:
    execution_count: int
    failed: bool
    timed_out: bool
    kernel_died: bool
    duration_ms: int


KernelEvent = StreamOutput | DisplayOutput | ResultOutput | ErrorOutput | CellDone


# -- jupyter message content -> events ---------------------------------------------------------------


def _is_text_mime(mime: str) -> bool:
    return (
        mime.startswith("text/")
        or mime in ("application/json", "application/javascript", "image/svg+xml")
        or mime.endswith(("+json", "+xml"))
    )


def mime_bytes(mime: str, value: object) -> bytes:
    """One value of a Jupyter MIME bundle as the bytes the contract promises: JSON values arrive
    parsed, text types are UTF-8, binary types arrive base64-encoded and leave decoded."""
    if not isinstance(value, str):
        return json.dumps(value).encode()
    if _is_text_mime(mime):
        return value.encode()
    try:
        return base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError):
        return value.encode()  # an unknown type that was not base64 after all


def mime_bundle(data: dict) -> dict[str, bytes]:
    return {mime: mime_bytes(mime, value) for mime, value in data.items()}


def output_event(msg: dict) -> KernelEvent | None:
    """The event an iopub message carries for the caller, if any."""
    kind, content = msg["msg_type"], msg["content"]
    if kind == "stream":
        return StreamOutput(content.get("name", "stdout"), content.get("text", ""))
    if kind in ("display_data", "update_display_data"):
        return DisplayOutput(mime_bundle(content.get("data", {})))
    if kind == "execute_result":
        return ResultOutput(mime_bundle(content.get("data", {})))
    if kind == "error":
        return error_event(content)
    return None


def error_event(content: dict) -> ErrorOutput:
    return ErrorOutput(content.get("ename", ""), content.get("evalue", ""), list(content.get("traceback", [])))


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


async def gather(events: AsyncIterator[KernelEvent], limit: int) -> GatheredCell:
    """Collects a cell's events; stdout and stderr keep their first and last `limit // 2` bytes
    each, so a cell that prints gigabytes cannot exhaust the daemon."""
    cell = GatheredCell()
    streams = {"stdout": HeadTailBuffer(limit), "stderr": HeadTailBuffer(limit)}
    async for event in events:
        if isinstance(event, StreamOutput):
            streams["stderr" if event.name == "stderr" else "stdout"].write(event.text.encode())
        elif isinstance(event, DisplayOutput):
            cell.displays.append(event)
        elif isinstance(event, ResultOutput):
            cell.result = event
        elif isinstance(event, ErrorOutput):
            cell.error = event
        elif isinstance(event, CellDone):
            cell.done = event
    cell.stdout = streams["stdout"].getvalue().decode(errors="replace")
    cell.stderr = streams["stderr"].getvalue().decode(errors="replace")
    cell.truncated = any(b.truncated for b in streams.values())
    return cell
