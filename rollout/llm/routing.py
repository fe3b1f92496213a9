"""The routing key: which rollout an LLM request belongs to, sent as an HTTP header so that a
router in front of several engines (SGLang's model gateway with its consistent_hashing or manual
policy) keeps a rollout's turns on one engine and its prefix cache warm.

The key travels in a context variable set around a call (`routed`), and an aiohttp client
middleware on the session adds the header to every request made inside it, so the HTTP clients
themselves need not know about rollouts. Servers that do not route ignore the header.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

_routing_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("corral_routing_key", default=None)


@contextmanager
def routed(key: str | None) -> Iterator[None]:
    """Requests made inside carry `key` as their routing key (none for None or "")."""
    token = _routing_key.set(key or None)
    try:
        yield
    finally:
        _routing_key.reset(token)


async def routing_key_header(request: Any, handler: Any) -> Any:
    """aiohttp client middleware: the current routing key as the routing header."""
    key = _routing_key.get()
    if key:
        request.headers[ROUTING_KEY_HEADER] = key
    return await handler(request)


def routed_session() -> aiohttp.ClientSession:
    """A session for LLM servers: no connection limit (the callers bound their own concurrency),
    the routing header on every request."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), middlewares=(routing_key_header,))
