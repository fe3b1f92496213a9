"""Host ids handed to sandboxes, a block each, shared by every backend of the daemon."""

from __future__ import annotations

from corral.sdk.errors import ResourceExhausted

from .users import INSIDE_ID_COUNT


class UidPool:
    """Hands each sandbox a block of `block` host ids of its own (uid and gid alike): ids 0 ..
    block - 1 inside the sandbox's user namespace are the block's, so root inside is an
    unprivileged host id that no other sandbox shares, and sandboxes cannot touch each other's
    files or processes even when they share the host network. `take` returns the block's first
    id, which backends without a user namespace use as the sandbox's one uid.

    `size` is the number of host ids in all (the `[sandbox] uid_count` setting): it holds
    size // block sandboxes at once."""

    def __init__(self, base: int, size: int, block: int = INSIDE_ID_COUNT) -> None:
        if size < block:
            raise ValueError(
                f"sandbox.uid_count must be at least {block} (one sandbox's block of host ids), got {size}"
            )
        self.base, self.size, self.block = base, size, block
        self.blocks = size // block
        self._next = 0
        self._released: list[int] = []
        self._used: set[int] = set()

    def take(self) -> int:
        if self._released:
            first = self._released.pop()
        elif self._next < self.blocks:
            first = self.base + self._next * self.block
            self._next += 1
        else:
            raise ResourceExhausted(
                f"all {self.blocks} blocks of {self.block} sandbox ids from {self.base} are in use "
                "(raise sandbox.uid_count for more sandboxes at once)"
            )
        self._used.add(first)
        return first

    def give_back(self, first: int) -> None:
        if first in self._used:
            self._used.discard(first)
            self._released.append(first)
