"""The pool of LLM servers the agent loop generates from: registered and removed at run time,
load-balanced, sticky per rollout, with failover.

Choosing a server for a call of rollout R:
- Candidates: registered servers that are healthy, plus servers out of rotation that have
  nothing in flight and whose health endpoint (GET /health) answered since they failed: it is
  asked once their cool-down after the failure has run out (or earlier, see "Waiting out a
  restart"). They get one probe request at a time; the first success makes them healthy again, a
  failure starts a new cool-down.
- Sticky: R goes to the server its previous call went to (its prefix is cached there) unless that
  server is no candidate or is overloaded: in_flight/weight > overload_factor * (the least loaded
  candidate's in_flight/weight) + 1. Otherwise (and for R's first call) the least loaded
  candidate: the lowest (in_flight + 1) / weight, ties to the fewest requests per weight, then to
  registration order. R then sticks to the server chosen.

Failures (see client.LLMServerError): connection errors, timeouts, 5xx and malformed answers
take the server out of rotation for `cooldown_s` and count a failure; 408/429 only count one. All
of those are retried, on a server this call has not tried when there is one, sleeping `backoff_s`
doubling up to `max_backoff_s` before a retry that cannot go to a fresh server. A call makes
`max_attempts` requests (attempts are requests, also with a single server) before it raises
LLMUnavailable. Any other 4xx raises LLMRequestRejected (a subclass of LLMUnavailable) at once:
the request would fail anywhere. No server registered: LLMUnavailable at once.

Waiting out a restart: when every server is out of rotation, a call does not spend its attempts
on servers known to be down. It polls their health endpoints (GET /health, one probe per server
every `health_interval_s` whoever waits) and goes on as soon as one answers, which ends that
server's cool-down early; it waits so at most `unavailable_wait_s` in all, then makes its
remaining attempts anyway. So a restart of the only server costs the rollouts waiting on it the
restart's time, not their sample.

Streaming (`on_delta` given): the server streams, and the deltas are passed on as they come. A
failure before the first delta is retried as above (nothing was shown to anyone); after it, the
ids already passed on cannot be taken back, so the call raises LLMUnavailable at once (the server
is taken out of rotation as for any failure). The routing key and the weight versions are those
of a whole generation.

`pool.generate` has GenerateFn's signature (and StreamingGenerateFn's), so the agent loop can take it directly, and
`pool.context_length` is the agent loop's context window (the smallest the servers report).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from yarl import URL

from corral.rollout.llm.client import LLMClient, LLMRequestRejected, LLMServerError
from corral.rollout.llm.routing import routed, routed_session
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.llm.vllm import VLLMClient
from corral.rollout.types import DeltaSink, Generation, GenerationDelta, LLMUnavailable, SamplingOptions
from corral.sdk.errors import AlreadyExists, InvalidArgument, NotFound

log = logging.getLogger(__name__)

PROTOCOLS = ("sglang", "vllm")


class ServerAlreadyRegistered(AlreadyExists):
    """register() for an address that is already in the pool (gRPC: ALREADY_EXISTS)."""


class UnknownServer(NotFound):
    """remove() for an address that is not in the pool (gRPC: NOT_FOUND)."""


@dataclass(frozen=True)
class ServerStats:
    """One server as snapshot() reports it (the fields of the LLMServer message)."""

    address: str
    protocol: str
    weight: int
    model: str
    in_flight: int
    healthy: bool
    requests: int
    failures: int


class _Server:
    def __init__(self, address: str, protocol: str, weight: int, model: str, order: int) -> None:
        self.address = address
        self.protocol = protocol
        self.weight = weight
        self.model = model
        self.order = order
        self.client: LLMClient | None = None
        self.in_flight = 0
        self.healthy = True
        self.down_until = 0.0
        self.requests = 0
        self.failures = 0
        self.removed = False
        # The health probe in flight or last done (shared by every call waiting on the server).
        self.health_probe: asyncio.Task[bool] | None = None
        self.health_probed_at = -math.inf
        # Out of rotation, and its health endpoint answered since: it may take a probe request.
        self.confirmed = False
        # The server's context window once it said (None: it reports none); unknown until then.
        self.context_length: int | None = None
        self.context_known = False
        # When a server that could not be asked is asked again (not on every turn of every rollout).
        self.context_retry_at = -math.inf

    @property
    def load(self) -> float:
        return self.in_flight / self.weight

    def is_candidate(self) -> bool:
        return self.healthy or (self.confirmed and self.in_flight == 0)

    def stats(self) -> ServerStats:
        return ServerStats(
            self.address,
            self.protocol,
            self.weight,
            self.model,
            self.in_flight,
            self.healthy,
            self.requests,
            self.failures,
        )


def normalize_address(address: str) -> str:
    """The base URL as the pool keys it ("http://host:port", no trailing slash); InvalidArgument when
    it is not an http(s) URL with a host."""
    text = address.strip().rstrip("/")
    if "://" not in text:
        text = "http://" + text
    try:
        url = URL(text)
    except ValueError as error:
        raise InvalidArgument(f"bad LLM server address {address!r}: {error}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InvalidArgument(f"bad LLM server address {address!r}: want http(s)://host:port")
    return str(url).rstrip("/")


def normalize_protocol(protocol: str) -> str:
    value = (protocol or "sglang").strip().lower()
    if value not in PROTOCOLS:
        raise InvalidArgument(f"unknown LLM protocol {protocol!r} (one of {', '.join(PROTOCOLS)})")
    return value


class LLMPool:
    """LLM servers shared by every rollout of a daemon; one aiohttp session for all of them
    (created on first use, closed by `close()` unless it was given). Every request carries its
    rollout's id as the routing key (llm/routing.py), on a given session only if it has the
    `routing_key_header` middleware."""

    def __init__(
        self,
        *,
        timeout_s: float = 600.0,
        max_attempts: int = 4,
        backoff_s: float = 0.25,
        max_backoff_s: float = 4.0,
        overload_factor: float = 2.0,
        cooldown_s: float = 15.0,
        unavailable_wait_s: float = 60.0,
        health_interval_s: float = 0.5,
        context_timeout_s: float = 5.0,
        session: aiohttp.ClientSession | None = None,
        max_sticky: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.overload_factor = overload_factor
        self.cooldown_s = cooldown_s
        self.unavailable_wait_s = unavailable_wait_s
        self.health_interval_s = health_interval_s
        self.context_timeout_s = context_timeout_s
        self.max_sticky = max_sticky
        self._clock = clock
        self._servers: dict[str, _Server] = {}
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._session = session
        self._owns_session = session is None
        self._registered = 0

    # ---- registry ----------------------------------------------------------------------------

    def register(self, address: str, protocol: str = "sglang", weight: int = 1, model: str = "") -> ServerStats:
        """Adds a server. InvalidArgument for a bad address/protocol/weight, ServerAlreadyRegistered
        when the address is in the pool already. Weight 0 means 1."""
        key = normalize_address(address)
        protocol = normalize_protocol(protocol)
        if weight < 0:
            raise InvalidArgument("weight must be >= 0")
        if key in self._servers:
            raise ServerAlreadyRegistered(f"LLM server {key} is already registered")
        self._registered += 1
        server = _Server(key, protocol, weight or 1, model, self._registered)
        self._servers[key] = server
        return server.stats()

    def remove(self, address: str) -> None:
        """Takes a server out: no new requests go to it; requests in flight finish. UnknownServer
        when it is not registered."""
        key = normalize_address(address)
        server = self._servers.pop(key, None)
        if server is None:
            raise UnknownServer(f"no LLM server {key} is registered")
        server.removed = True  # its client (on the shared session) goes with the last reference

    def __len__(self) -> int:
        return len(self._servers)

    def __contains__(self, address: str) -> bool:
        try:
            return normalize_address(address) in self._servers
        except InvalidArgument:
            return False

    def snapshot(self) -> list[ServerStats]:
        return [server.stats() for server in self._servers.values()]

    async def context_length(self) -> int | None:
        """The smallest context window the registered servers report (GET /v1/models'
        max_model_len), so that a request fits whichever server takes it; None when none reports
        one. Each server is asked until it answers once, the servers not known yet all at once
        (each for at most `context_timeout_s`). One that could not be asked is left out, and asked
        again only after `cooldown_s`: an unreachable server must not cost every turn of every
        rollout a wait."""
        now = self._clock()
        unknown = [s for s in self._servers.values() if not s.context_known and s.context_retry_at <= now]
        if unknown:
            await asyncio.gather(*(self._ask_context_length(server) for server in unknown))
        lengths = [s.context_length for s in self._servers.values() if s.context_known and s.context_length]
        return min(lengths) if lengths else None

    async def _ask_context_length(self, server: _Server) -> None:
        try:
            length = await asyncio.wait_for(self._client(server).context_length(), self.context_timeout_s)
        except (LLMServerError, TimeoutError):
            server.context_retry_at = self._clock() + self.cooldown_s
            return
        server.context_length, server.context_known = length, True

    def forget(self, rollout_id: str) -> None:
        """Drops the rollout's stickiness (call when the rollout ends)."""
        self._sticky.pop(rollout_id, None)

    # ---- generation --------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str, *, on_delta: DeltaSink | None = None
    ) -> Generation:
        if not self._servers:
            raise LLMUnavailable("no LLM server is registered")
        tried: set[str] = set()
        last_error = "no LLM server is available"
        backoff = self.backoff_s
        wait_deadline = self._clock() + self.unavailable_wait_s
        delivered = False
        sink: DeltaSink | None = None
        if on_delta is not None:
            deliver = on_delta

            def sink(delta: GenerationDelta) -> None:
                nonlocal delivered
                delivered = True
                deliver(delta)

        for attempt in range(self.max_attempts):
            await self._confirm_cooled_down()
            server = self._choose(rollout_id, tried)
            if attempt and (server is None or server.address in tried):
                # Nothing fresh to try: back off first.
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff_s)
                server = self._choose(rollout_id, tried)
            if server is None:
                server = await self._wait_for_server(rollout_id, tried, wait_deadline)
            if server is None:
                raise LLMUnavailable("no LLM server is registered")
            tried.add(server.address)
            try:
                with routed(rollout_id):
                    generation = await self._call(server, prompt_ids, sampling, sink)
            except LLMServerError as error:
                last_error = str(error)
                if delivered:
                    raise LLMUnavailable(
                        f"the LLM server failed after streaming part of the reply: {last_error}"
                    ) from None
                if not error.retryable:
                    raise LLMRequestRejected(last_error, server=server.address, status=error.status) from None
                continue
            self._stick(rollout_id, server.address)
            return generation
        raise LLMUnavailable(f"no LLM server could generate after {self.max_attempts} attempts: {last_error}")

    async def _wait_for_server(self, rollout_id: str, tried: set[str], deadline: float) -> _Server | None:
        """Every server is out of rotation: polls their health endpoints until one answers (its
        cool-down ends) or `deadline` passes; then the server for the attempt: a candidate, else
        (past the deadline) the one whose cool-down ends first. None when none is registered."""
        while True:
            server = self._choose(rollout_id, tried)
            if server is not None or not self._servers:
                return server
            if self._clock() >= deadline:
                return min(self._servers.values(), key=lambda s: (s.in_flight, s.down_until, s.order))
            for waiting in list(self._servers.values()):
                if not waiting.healthy and not waiting.confirmed:
                    waiting.confirmed = await self._healthy(waiting)
            if self._choose(rollout_id, tried) is None:
                await asyncio.sleep(max(0.0, min(self.health_interval_s, deadline - self._clock())))

    async def _confirm_cooled_down(self) -> None:
        """Asks the health endpoint of each server whose cool-down has run out whether it may
        take a probe request."""
        now = self._clock()
        for server in list(self._servers.values()):
            if not server.healthy and not server.confirmed and now >= server.down_until:
                server.confirmed = await self._healthy(server)

    async def _healthy(self, server: _Server) -> bool:
        """The server's health endpoint answers (one probe at a time and at most one per
        `health_interval_s`, shared by every call that asks)."""
        try:
            probe = server.health_probe
            if probe is None or (probe.done() and self._clock() - server.health_probed_at >= self.health_interval_s):
                server.health_probed_at = self._clock()
                probe = server.health_probe = asyncio.create_task(self._client(server).health())
            return await asyncio.shield(probe)
        except Exception:  # noqa: BLE001 - a probe that fails says "not healthy", whatever the cause
            return False

    async def _call(
        self, server: _Server, prompt_ids: list[int], sampling: SamplingOptions, on_delta: DeltaSink | None
    ) -> Generation:
        client = self._client(server)
        server.in_flight += 1
        server.requests += 1
        try:
            generation = await (
                client.generate(prompt_ids, sampling)
                if on_delta is None
                else client.generate(prompt_ids, sampling, on_delta)
            )
        except LLMServerError as error:
            server.failures += 1
            if error.take_out:
                if server.healthy:
                    log.warning(
                        "LLM server %s taken out of rotation for %.0f s: %s", server.address, self.cooldown_s, error
                    )
                server.healthy = False
                server.confirmed = False
                server.down_until = self._clock() + self.cooldown_s
            raise
        finally:
            server.in_flight -= 1
        if not server.healthy:
            log.info("LLM server %s is back in rotation", server.address)
            server.healthy = True
        return generation

    def _choose(self, rollout_id: str, tried: set[str]) -> _Server | None:
        """The server for the next attempt (see the module docstring); one already tried only when
        no untried candidate is left; None when no server is a candidate."""
        candidates = [s for s in self._servers.values() if s.is_candidate()]
        if not candidates:
            return None
        fresh = [s for s in candidates if s.address not in tried]
        pool = fresh or candidates
        least = min(pool, key=lambda s: ((s.in_flight + 1) / s.weight, s.requests / s.weight, s.order))
        sticky = self._servers.get(self._sticky.get(rollout_id, ""))
        if (
            sticky is not None
            and sticky in pool
            and sticky.healthy
            and sticky.load <= self.overload_factor * least.load + 1
        ):
            return sticky
        return least

    def _stick(self, rollout_id: str, address: str) -> None:
        self._sticky[rollout_id] = address
        self._sticky.move_to_end(rollout_id)
        while len(self._sticky) > self.max_sticky:
            self._sticky.popitem(last=False)

    def _client(self, server: _Server) -> LLMClient:
        if server.client is None:
            if self._session is None or self._session.closed:
                if not self._owns_session:
                    raise LLMServerError("the pool's HTTP session is closed", server=server.address, retryable=False)
                self._session = routed_session()
            if server.protocol == "vllm":
                server.client = VLLMClient(
                    server.address, session=self._session, timeout_s=self.timeout_s, model=server.model
                )
            else:
                server.client = SGLangClient(server.address, session=self._session, timeout_s=self.timeout_s)
        return server.client

    async def close(self) -> None:
        """Closes the shared session (when the pool created it). Registered servers stay."""
        for server in self._servers.values():
            if server.health_probe is not None:
                server.health_probe.cancel()
                server.health_probe = None
            server.client = None
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None
