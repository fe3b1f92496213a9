"""Starts ipykernel inside a sandbox with corral's output governor (run by the sandbox's python).

Not imported by the daemon: the daemon passes this file's text to `python -c`, with the per-stream
limit appended, so it must run on any Python and ipykernel (6 and 7) an image may carry, using
nothing but them.

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

If ipykernel's internals differ from what this expects, the kernel starts ungoverned rather than
not at all: the daemon's own caps still hold.
"""

import inspect
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


def main(limit):
    # As ipykernel_launcher does: the working directory leaves sys.path while ipykernel loads.
    if sys.path and sys.path[0] == "":
        del sys.path[0]
    try:
        install(limit)
    except (ImportError, AttributeError) as error:  # an ipykernel this does not know: run it ungoverned
        sys.stderr.write(f"corral: kernel output governor not installed: {error!r}\n")
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()
