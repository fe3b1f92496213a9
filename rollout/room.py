"""The node's room for the pipeline's sandboxes: how many its rollouts may hold at once.

A node admits at most `daemon.max_sandboxes` sandboxes, and counts one from its create until its
teardown has ended. Without a count of its own, the pipeline's INIT would start sandboxes while
rollouts waiting for RUN or EVAL hold theirs and while those of finished rollouts are still torn
down, and the node would refuse it: how often would depend on how fast teardowns run, that is on
the node's load. So an INIT first takes room for the sandboxes it is about to make (a shared INIT:
its set-up sandbox and one child per member) and waits, in turn, while the pipeline's own
sandboxes fill the node; a sandbox's room comes back once its Destroy has returned (or failed).
The node then refuses the pipeline only for sandboxes that are not its own.
"""

from __future__ import annotations

import asyncio
import collections


class SandboxRoom:
    """Room for `limit` sandboxes (0: no limit of its own), given out in the order it was asked
    for, so a shared INIT that needs much of it is not passed forever by INITs that need less."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._waiting: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    @property
    def waiting(self) -> int:
        """How many takers wait for room."""
        return len(self._waiting)

    def _fits(self, count: int) -> bool:
        # More than the limit never fits: it goes once nothing else is held (and the node, which
        # cannot take it either, refuses it as it would have without this count).
        return not self.limit or self.held + count <= self.limit or self.held == 0

    async def take(self, count: int) -> None:
        """Waits until `count` more sandboxes fit, after those who asked before, and takes their
        room. Cancelled while it waits, it takes nothing."""
        if not self._waiting and self._fits(count):
            self.held += count
            return
        turn = asyncio.get_running_loop().create_future()
        entry = (count, turn)
        self._waiting.append(entry)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give_back(count)  # granted just as it was cancelled
            else:
                self._waiting.remove(entry)
                self._grant()  # those behind it may fit now
            raise

    def try_take(self, count: int) -> bool:
        """Takes room for `count` if it fits now and nobody waits for room; whether it did."""
        if self._waiting or not self._fits(count):
            return False
        self.held += count
        return True

    def take_now(self, count: int) -> None:
        """Takes room for `count` without waiting, past the limit if need be."""
        self.held += count

    def give_back(self, count: int) -> None:
        if count:
            self.held -= count
            self._grant()

    def _grant(self) -> None:
        while self._waiting and self._fits(self._waiting[0][0]):
            count, turn = self._waiting.popleft()
            self.held += count
            turn.set_result(None)
