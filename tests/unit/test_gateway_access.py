"""The daemon's node listener for the LLM gateway."""

from __future__ import annotations

import socket

import pytest

from corral.daemon.config import ConfigError
from corral.daemon.gateway_access import GatewayAccess
from corral.rollout.gateway import Gateway
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.rollout.types import Generation, SamplingOptions


async def _never_called(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
    raise AssertionError("no generation is asked for")


async def test_a_taken_gateway_port_is_a_configuration_error_that_names_the_setting():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        access = GatewayAccess(Gateway(_never_called, ByteChatTokenizer()), sandboxes=None, listen=listen)
        try:
            with pytest.raises(ConfigError, match=rf"rollout.gateway_listen: cannot listen on {listen}: "):
                await access.start()
        finally:
            await access.close()
