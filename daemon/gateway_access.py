"""Where harnesses reach the daemon's LLM gateway: a TCP listener on the node (rollout.gateway_listen)
for harnesses on the host, and one listener per running harness inside its sandbox's network
namespace, on 127.0.0.1 there (netns_socket.py), for harnesses in sandboxes. A sandbox that
shares the node's network namespace uses the node's listener."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from corral.rollout.gateway import Gateway
from corral.rollout.types import SandboxFailure

from .backends.base import ManagedSandbox
from .config import ConfigError, gateway_address
from .netns_socket import listen_in_namespace_of, shares_host_network
from .sandboxes import SandboxManager


class GatewayAccess:
    """Serves `gateway` on the node and, on demand, inside sandboxes. `start()`, then `close()`."""

    def __init__(self, gateway: Gateway, sandboxes: SandboxManager, listen: str) -> None:
        self._gateway = gateway
        self._sandboxes = sandboxes
        self._listen = listen
        self.host_url = ""
        # The sandboxes' listeners share a runner of their own, so that each can be stopped alone.
        self._sandbox_runner = web.AppRunner(gateway.app, access_log=None)
        self._runner_ready = False

    async def start(self) -> str:
        """Starts the node's listener; returns its base URL (ending in /v1). ConfigError when it
        cannot listen there (the port is taken, the address is not the node's)."""
        host, port = gateway_address(self._listen)
        try:
            self.host_url = await self._gateway.listen_tcp(host, port)
        except OSError as err:
            raise ConfigError(
                f"rollout.gateway_listen: cannot listen on {self._listen}: {err.strerror or err}"
            ) from None
        return self.host_url

    async def close(self) -> None:
        if self._runner_ready:
            await self._sandbox_runner.cleanup()
        await self._gateway.close()

    @contextlib.asynccontextmanager
    async def in_sandbox(self, sandbox_id: str) -> AsyncIterator[str]:
        """The gateway's base URL as seen from inside the sandbox, served while the context lasts."""
        sandbox = self._sandboxes.get(sandbox_id)
        pid = sandbox.runtime.init_pid if isinstance(sandbox.runtime, ManagedSandbox) else 0
        if not pid:
            raise SandboxFailure(f"sandbox {sandbox_id} has no running init to reach its network from")
        try:
            if shares_host_network(pid):
                yield self.host_url
                return
            listener = await listen_in_namespace_of(pid)
        except OSError as error:
            raise SandboxFailure(f"cannot serve the LLM gateway inside sandbox {sandbox_id}: {error}") from error
        if not self._runner_ready:
            await self._sandbox_runner.setup()
            self._runner_ready = True
        port = listener.getsockname()[1]
        site = web.SockSite(self._sandbox_runner, listener)
        try:
            await site.start()
        except BaseException:
            listener.close()
            raise
        try:
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            await site.stop()  # closes the listener
