"""Warm pools: sandboxes started ahead of time, handed to CreateSandbox requests that match.

Each [[pool]] of the configuration keeps `size` ready sandboxes of one shape (PoolKey). A request
of that shape takes one (a hit) instead of starting a sandbox; the pool then starts a replacement
in the background. Starts are bounded over all pools by pools.max_starting, and a pool whose
sandboxes fail to start waits before trying again (pools.retry_initial_s, doubling up to
pools.retry_max_s) and then starts one sandbox at a time until one succeeds, so a broken image
costs one failed start per wait, not a busy loop.

A pooled sandbox is made exactly as a fresh one is (the same backend call with the same spec) and
nothing runs in it before it is taken, so what a caller finds inside is what a fresh sandbox
holds. What a request sets that does not shape the sandbox (labels, idle timeout) is applied when
it is taken, and its created time is the time it was taken. Until then the manager does not list
it, the idle reaper does not see it, and it counts against neither daemon.max_sandboxes nor the
memory admission; its state record is saved like any sandbox's, so a daemon that crashed reaps it
at its next start like every other leftover. While the node drains, the pools are paused: their
ready sandboxes are torn down and none is started until the drain ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from corral.sdk.types import PoolInfo

from .backends.base import Limits
from .config import PoolsConfig
from .metrics import Metrics

if TYPE_CHECKING:
    from .sandboxes import Sandbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolKey:
    """What a request must equal, after the node's defaults are filled in, to be served from a
    pool: everything of CreateSandboxRequest that is fixed when the sandbox is made."""

    backend: str
    image: str
    limits: Limits
    network: bool
    env: tuple[tuple[str, str], ...]  # sorted
    user: str


@dataclass
class _Pool:
    name: str
    key: PoolKey
    size: int
    ready: deque[Sandbox] = field(default_factory=deque)
    starting: int = 0
    failures: int = 0  # failed starts in a row
    retry_at: float = 0.0  # monotonic; no start before it
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class WarmPools:
    """The node's pools. `make(key)` starts an unlisted sandbox of that shape (or raises);
    `discard(sandbox)` tears down one never handed out."""

    def __init__(
        self,
        settings: PoolsConfig,
        metrics: Metrics,
        make: Callable[[PoolKey], Awaitable[Sandbox]],
        discard: Callable[[Sandbox], Awaitable[None]],
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._make = make
        self._discard = discard
        self._pools: dict[PoolKey, _Pool] = {}
        self._starts = asyncio.Semaphore(settings.max_starting)
        self._starting = 0  # over all pools; never above settings.max_starting
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self._closed = asyncio.Event()
        self._paused = False  # the node drains: no refilling

    def add(self, name: str, key: PoolKey, size: int) -> None:
        """A pool; two entries of the same shape are one pool of both sizes."""
        pool = self._pools.get(key)
        if pool is not None:
            pool.size += size
            return
        self._pools[key] = _Pool(name, key, size)
        self.metrics.pool_depth.labels(name).set(0)

    def start(self) -> None:
        for pool in self._pools.values():
            self._spawn(self._refill(pool))

    def take(self, key: PoolKey) -> Sandbox | None:
        """A ready sandbox of this shape, or None (a miss: the caller starts one)."""
        pool = self._pools.get(key)
        while pool is not None and pool.ready:
            sandbox = pool.ready.popleft()
            pool.wake.set()
            self.metrics.pool_depth.labels(pool.name).set(len(pool.ready))
            if sandbox.runtime is not None and sandbox.runtime.alive():
                self.metrics.pool_hits.labels(pool.name).inc()
                return sandbox
            log.warning("pooled sandbox %s of pool %s died while waiting; discarded", sandbox.sandbox_id, pool.name)
            self._spawn(self._discard(sandbox))
        self.metrics.pool_misses.labels(pool.name if pool else "none").inc()
        return None

    def status(self) -> list[PoolInfo]:
        """What GetNodeInfo says of each pool (the SDK's own type: the same fields)."""
        return [
            PoolInfo(p.name, p.key.backend, p.key.image, p.size, len(p.ready), p.starting) for p in self._pools.values()
        ]

    async def pause(self) -> None:
        """Stops refilling (the node drains) and tears down the ready sandboxes; starts under
        way are torn down when they finish."""
        self._paused = True
        ready = [sb for pool in self._pools.values() for sb in pool.ready]
        for pool in self._pools.values():
            pool.ready.clear()
            self.metrics.pool_depth.labels(pool.name).set(0)
        await asyncio.gather(*(self._discard(sb) for sb in ready), return_exceptions=True)

    def resume(self) -> None:
        """Refills again, after pause."""
        self._paused = False
        for pool in self._pools.values():
            pool.wake.set()

    async def close(self) -> None:
        """Stops refilling, waits for starts in flight, and tears down every pooled sandbox."""
        self._closing = True
        self._closed.set()
        for pool in self._pools.values():
            pool.wake.set()
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        ready = [sb for pool in self._pools.values() for sb in pool.ready]
        for pool in self._pools.values():
            pool.ready.clear()
            self.metrics.pool_depth.labels(pool.name).set(0)
        await asyncio.gather(*(self._discard(sb) for sb in ready), return_exceptions=True)

    # -- refilling ---------------------------------------------------------------------------------

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _refill(self, pool: _Pool) -> None:
        while not self._closing:
            pool.wake.clear()
            # A pool whose last start failed tries one sandbox at a time until one starts.
            if self._paused or len(pool.ready) + pool.starting >= pool.size or (pool.failures and pool.starting):
                await pool.wake.wait()
                continue
            wait = pool.retry_at - time.monotonic()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closed.wait(), wait)
                continue
            await self._starts.acquire()
            if self._closing or self._paused or pool.retry_at > time.monotonic() or (pool.failures and pool.starting):
                self._starts.release()  # closed or paused, or a start of this pool failed while it waited
                continue
            pool.starting += 1
            self._starting += 1
            self.metrics.pool_starting.set(self._starting)
            self._spawn(self._start_one(pool))

    async def _start_one(self, pool: _Pool) -> None:
        began = time.monotonic()
        try:
            sandbox = await self._make(pool.key)
        except Exception:
            pool.failures += 1
            delay = min(self.settings.retry_initial_s * 2 ** (pool.failures - 1), self.settings.retry_max_s)
            pool.retry_at = time.monotonic() + delay
            self.metrics.pool_start_failures.labels(pool.name).inc()
            log.warning("pool %s: a sandbox failed to start; next try in %.1f s", pool.name, delay, exc_info=True)
        else:
            pool.failures = 0
            self.metrics.pool_refill_seconds.labels(pool.name).observe(time.monotonic() - began)
            if self._closing or self._paused:
                await self._discard(sandbox)
            else:
                pool.ready.append(sandbox)
                self.metrics.pool_depth.labels(pool.name).set(len(pool.ready))
        finally:
            pool.starting -= 1
            self._starting -= 1
            self.metrics.pool_starting.set(self._starting)
            self._starts.release()
            pool.wake.set()
