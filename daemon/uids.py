"""Host uids handed to sandboxes, one each, shared by every backend of the daemon."""

from __future__ import annotations

from itertools import count

from corral.sdk.errors import ResourceExhausted


class UidPool:
    """Hands each sandbox its own host uid, so sandboxes cannot touch each other's files or
    processes even when they share the host network."""

    def __init__(self, base: int, size: int) -> None:
        self.base, self.size = base, size
        self._free = count(base)
        self._released: list[int] = []
        self._used: set[int] = set()

    def take(self) -> int:
        uid = self._released.pop() if self._released else next(self._free)
        if uid >= self.base + self.size:
            raise ResourceExhausted(f"all {self.size} sandbox uids from {self.base} are in use")
        self._used.add(uid)
        return uid

    def give_back(self, uid: int) -> None:
        if uid in self._used:
            self._used.discard(uid)
            self._released.append(uid)
