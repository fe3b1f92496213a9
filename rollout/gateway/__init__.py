"""The LLM gateway: an HTTP endpoint per rollout in OpenAI's, Anthropic's and Gemini's APIs that forwards to the LLM
servers token-in/token-out and records every call's exact ids into trainable samples.

See docs/gateway.md. Modules: render (requests into template messages and ids), assembly (calls
into samples, with the prefix/splice/split rules), session (one rollout's call path and limits),
streaming (streamed calls' events and what of a reply may be shown yet), openai_api (the chat and
completions wire format), responses_api (OpenAI's Responses API), anthropic_api (Anthropic's
Messages API), app (the aiohttp server), errors.
"""

from corral.rollout.gateway.app import Gateway
from corral.rollout.gateway.assembly import GatewayCounters, HistoryPolicy, TrajectoryAssembler
from corral.rollout.gateway.errors import GatewayError, HistoryRewritten
from corral.rollout.gateway.session import GatewayOutcome, GatewaySession, SessionSettings

__all__ = [
    "Gateway",
    "GatewayCounters",
    "GatewayError",
    "GatewayOutcome",
    "GatewaySession",
    "HistoryPolicy",
    "HistoryRewritten",
    "SessionSettings",
    "TrajectoryAssembler",
]
