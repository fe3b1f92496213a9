"""Idempotency keys of CreateSandbox: a retried create returns the sandbox of its key.

The first create with a key runs as a task of its own, so that it finishes whoever waits for it:
a caller that gave up (its deadline) and retries finds it still under way and waits for the same
sandbox, and concurrent retries all get the one sandbox. A key names its sandbox while that
sandbox lives, for at most `window_s` after the create; a create that failed forgets its key, so
a retry tries again. The same key with another request is FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from corral.sdk.errors import FailedPrecondition, InvalidArgument

MAX_KEY_CHARS = 128
T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    request: Hashable
    task: asyncio.Future[T]
    began: float  # monotonic


class IdempotentCreates(Generic[T]):
    """`alive(result)` says whether a finished create's result (its sandbox) still lives."""

    def __init__(self, window_s: float, alive: Callable[[T], bool], clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._alive = alive
        self._clock = clock
        self._keys: dict[tuple[str, str], _Entry[T]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    async def create(
        self, key: str, request: Hashable, make: Callable[[], Awaitable[T]], *, owner: str = ""
    ) -> tuple[T, bool]:
        """(the result of `make()` for this key, whether an earlier create with it gave it). Keys
        are `owner`'s own: the same key of another owner is another key (callers.py)."""
        if len(key) > MAX_KEY_CHARS:
            raise InvalidArgument(f"idempotency_key must be at most {MAX_KEY_CHARS} characters, got {len(key)}")
        self._forget_stale()
        scoped = (owner, key)
        entry = self._keys.get(scoped)
        hit = entry is not None
        if entry is None:
            entry = _Entry(request, asyncio.ensure_future(make()), self._clock())
            self._keys[scoped] = entry
            entry.task.add_done_callback(lambda task: self._done(scoped, task))
        elif entry.request != request:
            raise FailedPrecondition(
                f"idempotency_key {key!r} was used for a different CreateSandbox request on this node: "
                "a retry must repeat the request exactly, a new request needs a new key"
            )
        return await asyncio.shield(entry.task), hit

    def _done(self, key: tuple[str, str], task: asyncio.Future[T]) -> None:
        if task.cancelled() or task.exception() is not None:  # (retrieves it: no "never retrieved")
            entry = self._keys.get(key)
            if entry is not None and entry.task is task:
                del self._keys[key]

    def _forget_stale(self) -> None:
        """Drops the keys past their window, and those whose sandbox is gone."""
        now = self._clock()
        for key, entry in list(self._keys.items()):
            task = entry.task
            if not task.done():
                continue
            failed = task.cancelled() or task.exception() is not None
            if failed or now - entry.began > self.window_s or not self._alive(task.result()):
                del self._keys[key]
