"""Capped output buffers: the head and the tail of a stream survive, the middle is counted."""

from __future__ import annotations


class HeadTailBuffer:
    """Keeps the first `limit // 2` and the last `limit - limit // 2` bytes of everything written.

    Agents need both ends of a long output: the command's start (what it was doing) and its end
    (the error). Bytes are never decoded or altered.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0
        self._skipped = False

    def write(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data:
            self._tail += data
            excess = len(self._tail) - self.tail_limit
            if excess > 0:
                del self._tail[:excess]

    def skip(self, count: int) -> None:
        """`count` bytes were dropped before what comes next (by a producer that keeps only head
        and tail itself): they count, and the tail kept so far no longer ends the output."""
        if count > 0:
            self.total += count
            self._skipped = True
            self._tail.clear()

    @property
    def truncated(self) -> bool:
        return self.total > self.limit or self._skipped

    def getvalue(self) -> bytes:
        return bytes(self._head + self._tail)


def _utf8_sequence_length(lead: int) -> int:
    if lead >= 0xF0:
        return 4
    if lead >= 0xE0:
        return 3
    if lead >= 0xC0:
        return 2
    return 1


def utf8_safe(buffer: HeadTailBuffer) -> bytes:
    """The buffer's value with the cut between head and tail moved to UTF-8 character boundaries,
    so that truncation never leaves half a character (for text; other bytes are left alone)."""
    head, tail = bytes(buffer._head), bytes(buffer._tail)
    for back in range(1, min(4, len(head)) + 1):
        byte = head[-back]
        if byte & 0xC0 != 0x80:  # the last lead byte: is its sequence complete?
            if byte >= 0xC0 and _utf8_sequence_length(byte) > back:
                head = head[:-back]
            break
    skip = 0
    while skip < min(3, len(tail)) and tail[skip] & 0xC0 == 0x80:
        skip += 1
    return head + tail[skip:]
