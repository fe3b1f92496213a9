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

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def getvalue(self) -> bytes:
        return bytes(self._head + self._tail)
