"""Starts ipykernel inside a sandbox with corral's output governor (run by the sandbox's python).

The daemon passes this file's text to `python -c`, with the limits appended, so it must run on
any Python and ipykernel (6 and 7) an image may carry, using nothing but them. (The daemon also
imports its pure functions: see below.)

Why: a cell can print gigabytes far faster than the daemon can read them. ipykernel buffers what a
cell prints for up to 0.2 s and publishes it as one message, and its iopub socket drops messages
once a slow reader is 1,000 behind, so the daemon would both hold hundreds of MB and count a
fraction of what was printed. The governor bounds it at the source: per cell (and per gap between
cells), each stream forwards its first `limit` bytes as usual, keeps only the last `limit` bytes of
the rest, and counts everything. At the cell's end the kept tail goes out as one stream message
marked with `corral_skipped` (the bytes dropped before it), and the execute reply carries the
exact totals (`corral_output`). Output of the gap between cells is reported the same way when the
next cell starts, before the kernel says it is busy with it. Processes forked from the kernel write through their own path and are not
governed (the daemon caps what it receives from them).

The same holds for what a cell returns, raises or displays: a cell's value (execute_result), its
error or a display can be hundreds of MB, and used to reach the daemon whole, JSON and all. So
every such message is cut before the kernel serializes it (see `bound_result` and `bound_error`):
each text past `limit` keeps its first and last halves at character boundaries, the rest of a
result is kept up to `display_limit` bytes, and the message says `corral_truncated` with
`corral_total_bytes`; a display larger than `display_limit` alone goes without its data, marked
`corral_dropped` (the daemon drops displays whole past that cap, and counts them). The
daemon imports these pure functions to apply the same bounds to a kernel that runs without them.

If ipykernel's internals differ from what this expects, the kernel starts ungoverned rather than
not at all: the daemon's own caps still hold.
"""

import inspect
import json
import sys
import threading


class Window:
    """One stream's output for one cell (or one gap between cells)."""

    def __init__(self, limit):
        self.limit = limit
        self.total = 0
        self.forwarded = 0
        self.skipped = 0
        self.tail = bytearray()

    def admit(self, text):
        """The part of `text` to forward now; the rest is counted, and its end kept."""
        data = text.encode("utf-8", "replace")
        self.total += len(data)
        room = self.limit - self.forwarded
        if len(data) <= room:
            self.forwarded += len(data)
            return text
        kept = data[: max(room, 0)].decode("utf-8", "ignore")
        self.forwarded = self.limit
        self.tail += data[len(kept.encode("utf-8")) :]
        excess = len(self.tail) - self.limit
        if excess > 0:
            self.skipped += excess
            del self.tail[:excess]
        return kept

    def closing_message(self):
        """(text, skipped) of the kept tail, or None when nothing was held back."""
        if not self.tail:
            return None
        data = bytes(self.tail)
        start = 0
        while start < min(3, len(data)) and data[start] & 0xC0 == 0x80:
            start += 1  # a character cut at the start of the tail is dropped whole, and counted
        return data[start:].decode("utf-8", "replace"), self.skipped + start


class Governor:
    def __init__(self, limit):
        self.limit = limit
        self.lock = threading.Lock()
        self.streams = {}  # name -> the OutStream
        self.windows = {}  # name -> Window
        # The parent header the held-back tail goes out under: the cell's, or for the gap after
        # it the same (by then the streams already carry the next cell's).
        self.parent = {}
        self.opened_for = None  # the msg_id of the cell whose window is open

    def window(self, stream):
        name = stream.name
        self.streams.setdefault(name, stream)
        if name not in self.windows:
            self.windows[name] = Window(self.limit)
        return self.windows[name]

    def close_window(self):
        """Flushes what was forwarded, then sends each stream's held-back tail; starts afresh.
        Returns the window's totals per stream."""
        for stream in list(self.streams.values()):
            stream.flush()
        with self.lock:
            windows, self.windows = self.windows, {}
        totals = {}
        for name, window in windows.items():
            totals[name] = window.total
            closing = window.closing_message()
            stream = self.streams.get(name)
            if closing is None or stream is None:
                continue
            text, skipped = closing
            stream.session.send(
                stream.pub_thread,
                "stream",
                content={"name": name, "text": text, "corral_skipped": skipped},
                parent=self.parent,
                ident=stream.topic,
            )
        return totals


# -- results and errors ----------------------------------------------------------------------------


def is_text_mime(mime):
    """MIME types whose values are text (UTF-8 on the wire); the others are binary (base64 in a
    Jupyter message) or JSON."""
    return (
        mime.startswith("text/")
        or mime in ("application/json", "application/javascript", "image/svg+xml")
        or mime.endswith(("+json", "+xml"))
    )


def utf8_length(text):
    """The UTF-8 bytes of `text` (a lone surrogate counts as '?'), without encoding it whole."""
    if text.isascii():
        return len(text)
    step = 1 << 20
    return sum(len(text[i : i + step].encode("utf-8", "replace")) for i in range(0, len(text), step))


def text_head(text, limit):
    """The longest start of `text` within `limit` UTF-8 bytes (never half a character)."""
    if limit <= 0:
        return ""
    return text[:limit].encode("utf-8", "replace")[:limit].decode("utf-8", "ignore")


def text_tail(text, limit):
    """The longest end of `text` within `limit` UTF-8 bytes (never half a character)."""
    if limit <= 0:
        return ""
    return text[-limit:].encode("utf-8", "replace")[-limit:].decode("utf-8", "ignore")


def cut_text(text, limit):
    """(text, total): `text` within `limit` UTF-8 bytes, as a gathered stream is cut: its first
    `limit // 2` and last `limit - limit // 2` bytes, at character boundaries; `total` counts it
    all."""
    total = utf8_length(text)
    if total <= limit:
        return text, total
    return text_head(text, limit // 2) + text_tail(text, limit - limit // 2), total


def cut_lines(lines, limit):
    """(lines, total): text lines (a traceback) within `limit` UTF-8 bytes together, cut as
    `cut_text` cuts their concatenation, but keeping the lines apart: whole lines from both ends,
    and the pieces of the two lines the cut falls in."""
    sizes = [utf8_length(line) for line in lines]
    total = sum(sizes)
    if total <= limit:
        return list(lines), total
    head = _lines_within(lines, sizes, limit // 2, text_head)
    tail = _lines_within(lines[::-1], sizes[::-1], limit - limit // 2, text_tail)
    return head + tail[::-1], total


def _lines_within(lines, sizes, room, piece_of):
    """Whole lines, in order, while they fit in `room` bytes, then `piece_of` the next one."""
    kept = []
    for line, size in zip(lines, sizes):
        if size > room:
            piece = piece_of(line, room)
            if piece:
                kept.append(piece)
            break
        kept.append(line)
        room -= size
    return kept


def value_size(mime, value):
    """The bytes a value of a Jupyter MIME bundle stands for, as the daemon decodes it: text as
    UTF-8, base64 of a binary type as the bytes it encodes, anything else as its JSON."""
    if not isinstance(value, str):
        return len(json.dumps(value))
    if is_text_mime(mime):
        return utf8_length(value)
    blanks = sum(value.count(c) for c in " \t\r\n")
    encoded = len(value) - blanks
    if encoded % 4:  # not base64 after all: the daemon keeps it as text
        return utf8_length(value)
    return encoded // 4 * 3 - value[-8:].rstrip()[-2:].count("=")


def bound_result(data, limit, display_limit):
    """(data, truncated, total) of a cell's value, a MIME bundle as Jupyter sends it: each text
    value past `limit` bytes keeps its first and last halves (cut_text); then the values are kept
    in order while they fit in `display_limit` bytes together, and dropped whole past it (binary
    and JSON values cannot be cut). `total` counts every value before any cut."""
    kept, size, total, truncated = {}, 0, 0, False
    for mime, value in data.items():
        if isinstance(value, str) and is_text_mime(mime):
            value, whole = cut_text(value, limit)
            truncated = truncated or whole > limit
            length, total = utf8_length(value), total + whole
        else:
            length = value_size(mime, value)
            total += length
        if size + length > display_limit:
            truncated = True
            continue
        kept[mime] = value
        size += length
    return kept, truncated, total


def bound_error(ename, evalue, traceback, limit):
    """(evalue, traceback, truncated, total) of an error: its message and its traceback each
    within `limit` bytes (cut_text, cut_lines); `total` counts its name, message and traceback
    before any cut."""
    evalue, evalue_total = cut_text(evalue, limit)
    traceback, traceback_total = cut_lines(traceback, limit)
    truncated = evalue_total > limit or traceback_total > limit
    return evalue, traceback, truncated, utf8_length(ename) + evalue_total + traceback_total


def bound_content(kind, content, limit, display_limit):
    """Cuts, in place, the content of an outgoing execute_result, error or failed execute_reply
    to the bounds above, marking it `corral_truncated` with `corral_total_bytes` when cut. A
    display past `display_limit` bytes on its own, which the daemon would drop whole, leaves
    without its data, marked `corral_dropped`, for the daemon to count."""
    if kind in ("display_data", "update_display_data") and isinstance(content.get("data"), dict):
        if sum(value_size(mime, value) for mime, value in content["data"].items()) > display_limit:
            content["data"] = {}
            content["corral_dropped"] = True
        return
    if kind == "execute_result" and isinstance(content.get("data"), dict):
        data, truncated, total = bound_result(content["data"], limit, display_limit)
        if truncated:
            content["data"] = data
    elif kind == "error" or (kind == "execute_reply" and content.get("status") == "error"):
        ename, evalue, traceback = content.get("ename"), content.get("evalue"), content.get("traceback")
        if not isinstance(evalue, str) or not isinstance(traceback, list):
            return
        ename = ename if isinstance(ename, str) else ""
        evalue, lines, truncated, total = bound_error(ename, evalue, [str(line) for line in traceback], limit)
        if truncated:
            content["evalue"] = evalue
            traceback[:] = lines  # in place: IPython keeps the list (_last_traceback) for the reply
    else:
        return
    if truncated:
        content["corral_truncated"] = True
        content["corral_total_bytes"] = total


_BOUNDED = ("execute_result", "error", "execute_reply", "display_data", "update_display_data")


def install_result_bounds(limit, display_limit):
    """Bounds what the kernel sends of results and errors (bound_content), at the one place every
    message passes before it is serialized: its Session's send."""
    from jupyter_client.session import Session

    original_send = Session.send

    def send(self, stream, msg_or_type, content=None, *args, **kwargs):
        if isinstance(msg_or_type, dict):
            kind, body = msg_or_type.get("msg_type"), msg_or_type.get("content")
        else:
            kind, body = msg_or_type, content
        if kind in _BOUNDED and isinstance(body, dict):
            bound_content(kind, body, limit, display_limit)
        return original_send(self, stream, msg_or_type, content, *args, **kwargs)

    Session.send = send


# -- the kernel ---------------------------------------------------------------------------------------


def install(limit):
    from ipykernel.iostream import OutStream
    from ipykernel.ipkernel import IPythonKernel

    governor = Governor(limit)
    original_write = OutStream.write
    original_execute = IPythonKernel.do_execute
    original_set_parent = IPythonKernel.set_parent

    def write(self, string):
        if not isinstance(string, str) or not self._is_master_process():
            return original_write(self, string)
        with governor.lock:  # held while writing, so that threads' writes keep their order
            kept = governor.window(self).admit(string)
            if kept:
                original_write(self, kept)
        return len(string)

    def set_parent(self, ident, parent, *args, **kwargs):
        # A new cell's request: the gap since the previous cell ends here, before the kernel
        # publishes that it is busy with it, so the gap's tail reaches the daemon as output of
        # the previous cell (the daemon delivers such output first thing in the next cell).
        header = parent.get("header", {}) if isinstance(parent, dict) else {}
        if header.get("msg_type") == "execute_request" and header.get("msg_id") != governor.opened_for:
            governor.opened_for = header.get("msg_id")
            governor.close_window()
        return original_set_parent(self, ident, parent, *args, **kwargs)

    async def do_execute(self, *args, **kwargs):
        reply = original_execute(self, *args, **kwargs)
        if inspect.isawaitable(reply):
            reply = await reply
        governor.parent = self.get_parent("shell")  # the gap after the cell counts as the cell's
        totals = governor.close_window()
        if isinstance(reply, dict):
            reply["corral_output"] = totals
        return reply

    OutStream.write = write
    IPythonKernel.do_execute = do_execute
    IPythonKernel.set_parent = set_parent


def main(limit, display_limit):
    # As ipykernel_launcher does: the working directory leaves sys.path while ipykernel loads.
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    try:
        install(limit)
    except (ImportError, AttributeError) as error:  # an ipykernel this does not know: run it ungoverned
        sys.stderr.write(f"corral: kernel output governor not installed: {error!r}\n")
    try:
        install_result_bounds(limit, display_limit)
    except (ImportError, AttributeError) as error:  # the daemon still cuts what arrives
        sys.stderr.write(f"corral: kernel result bounds not installed: {error!r}\n")
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()
