"""Admission of new sandboxes: against the node's memory (daemon.memory_overcommit), and by the
pace of creates ([admission]: CreateGate).

The memory limits of the sandboxes on a node may add up to the overcommit factor times its
physical memory: past that, CreateSandbox is refused with RESOURCE_EXHAUSTED before anything is
made, instead of admitting sandboxes that the kernel's OOM killer would later have to choose
between. A sandbox without a memory limit counts as the whole node.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator

from corral.sdk.errors import ResourceExhausted

GIB = 1 << 30


def node_memory_bytes(meminfo: str = "/proc/meminfo") -> int:
    """The node's physical memory (MemTotal)."""
    with open(meminfo) as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key == "MemTotal":
                return int(rest.split()[0]) * 1024
    raise OSError(f"no MemTotal in {meminfo}")


def counted_bytes(memory_limit: int, node_bytes: int) -> int:
    """What one sandbox counts against the node: its limit, or all of the node without one."""
    return memory_limit or node_bytes


def admit_memory(held_limits: Iterable[int], wanted: int, node_bytes: int, overcommit: float) -> None:
    """Raises ResourceExhausted when a sandbox with the memory limit `wanted` (0: none) would take
    the sum of the limits `held_limits` of the node's sandboxes past `overcommit` x `node_bytes`.
    An overcommit of 0 admits everything."""
    if not overcommit:
        return
    capacity = int(overcommit * node_bytes)
    held = sum(counted_bytes(limit, node_bytes) for limit in held_limits)
    asked = counted_bytes(wanted, node_bytes)
    if held + asked > capacity:
        raise ResourceExhausted(
            f"not enough memory on this node for a sandbox with a {_gib(asked)} memory limit: its "
            f"sandboxes' limits already add up to {_gib(held)} of the {_gib(capacity)} admitted "
            f"(daemon.memory_overcommit {overcommit:g} x {_gib(node_bytes)} of memory); destroy "
            "sandboxes, ask for a smaller limits.memory_bytes, or use another node"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


class CreateGate:
    """Admission of creates by pace ([admission]): at most `max_starting` sandboxes being started
    at once, and at most `max_creates_per_s` creates per second (a token bucket of `burst`
    tokens). `check_rate` and `check_start` raise ResourceExhausted carrying a retry hint
    (`retry_after_s`) and take nothing; `take` spends a token once the create is committed, and
    `starting_slots()` holds a start slot while a sandbox is being made. A refused create spends
    nothing. 0 for either cap: no cap.

    Each takes a count for ForkSandbox, whose `count` children are that many creates and starts.
    A fork larger than a cap is not refused for good: it passes the rate with a full bucket and
    spends its count all the same (the bucket's debt delays the creates after it), and passes
    max_starting when nothing else is starting."""

    # The first hint for a full start slot, before any start was timed; then an average.
    FIRST_START_S = 1.0

    def __init__(
        self, max_starting: int, max_creates_per_s: float, burst: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_starting = max_starting
        self.rate = max_creates_per_s
        self.burst = float(burst or max(1, math.ceil(max_creates_per_s)))
        self._clock = clock
        self._tokens = self.burst
        self._refilled_at = clock()
        self.starting = 0
        self._start_s = self.FIRST_START_S  # a moving average of how long a start takes

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._refilled_at) * self.rate)
        self._refilled_at = now

    def check_rate(self, count: int = 1) -> None:
        if not self.rate:
            return
        self._refill()
        needed = min(count, self.burst)
        if self._tokens < needed:
            wait = (needed - self._tokens) / self.rate
            raise RateRefused(
                f"this node takes at most {self.rate:g} creates per second (admission.max_creates_per_s); "
                f"retry in {wait * 1000:.0f} ms",
                retry_after_s=wait,
            )

    def check_start(self, count: int = 1) -> None:
        if self.max_starting and self.starting and self.starting + count > self.max_starting:
            wait = self._start_s
            raise StartsRefused(
                f"this node is already starting {self.starting} sandboxes"
                f"{f', and {count} more would pass its {self.max_starting}' if count > 1 else ''} "
                f"(admission.max_starting); retry in {wait * 1000:.0f} ms",
                retry_after_s=wait,
            )

    def take(self, count: int = 1) -> None:
        """Spends `count` tokens of the rate (after check_rate passed, with no await in between)."""
        if self.rate:
            self._refill()
            self._tokens -= count

    @contextlib.contextmanager
    def starting_slots(self, count: int = 1) -> Iterator[None]:
        """Holds `count` start slots while that many sandboxes are made together; times the
        start for the retry hint."""
        self.starting += count
        began = self._clock()
        try:
            yield
        finally:
            self.starting -= count
            self._start_s = 0.8 * self._start_s + 0.2 * max(self._clock() - began, MIN_RETRY_S)


# The shortest retry hint given (a hint of 0 would invite a busy loop).
MIN_RETRY_S = 0.05


class AdmissionRefused(ResourceExhausted):
    """RESOURCE_EXHAUSTED from the pace of creates; `reason` labels the refusal metric."""

    reason = ""

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=max(retry_after_s, MIN_RETRY_S))


class RateRefused(AdmissionRefused):
    reason = "rate"


class StartsRefused(AdmissionRefused):
    reason = "starting"
