"""Token-in/token-out client for vLLM's OpenAI-compatible POST /v1/completions.

Request: {"model", "prompt": [ids], "max_tokens", "temperature", "top_p", "top_k", "stop",
"stop_token_ids", "logprobs": 1, "return_token_ids": true, "return_tokens_as_token_ids": true,
"skip_special_tokens": false, "include_stop_str_in_output": true, "n": 1, "stream": false}.

Response: choices[0] with "token_ids" (vLLM >= 0.10.2 with return_token_ids; older releases:
read from logprobs.tokens, which return_tokens_as_token_ids writes as "token_id:<id>"),
"logprobs": {"token_logprobs": [...]}, "finish_reason" ("stop" | "length" | "abort") and
"stop_reason" (the stop token id, the stop string, or null for EOS).

vLLM's token ids keep the token generation stopped on; should a server drop it all the same
(finish "stop", an int stop_reason that is not the last id), the client appends it with logprob
0.0 (unknown). vLLM reports no weight version: Generation.weight_version is None.

The model name: the one given, else the first of GET /v1/models (asked once). The context window:
that entry's "max_model_len" (`context_length`), which the agent loop keeps every request within.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from corral.rollout.llm.client import (
    HTTPClientBase,
    LLMServerError,
    int_or_none,
    optional_sampling_fields,
    protocol_error,
)
from corral.rollout.types import Generation, SamplingOptions

_TOKEN_ID_PREFIX = "token_id:"


class VLLMClient(HTTPClientBase):
    """One vLLM server. Every failure raises LLMServerError (see client.py)."""

    protocol = "vllm"

    def __init__(
        self, base_url: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 600.0, model: str = ""
    ) -> None:
        super().__init__(base_url, session=session, timeout_s=timeout_s)
        self.model = model
        self._model_lock = asyncio.Lock()

    async def resolve_model(self) -> str:
        """The model name requests carry: the configured one, else the server's first."""
        if self.model:
            return self.model
        async with self._model_lock:
            if not self.model:
                models = await self.models()
                if not models or not models[0].get("id"):
                    raise protocol_error(self.base_url, "GET /v1/models lists no model")
                self.model = str(models[0]["id"])
        return self.model

    def request_body(self, model: str, input_ids: list[int], sampling: SamplingOptions) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(input_ids),
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "n": 1,
            "stream": False,
        }
        body.update(optional_sampling_fields(sampling))
        return body

    async def generate(self, input_ids: list[int], sampling: SamplingOptions) -> Generation:
        model = await self.resolve_model()
        data = await self._request("POST", "/v1/completions", self.request_body(model, input_ids, sampling))
        return self.parse(data)

    def parse(self, data: Any) -> Generation:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise protocol_error(self.base_url, "the completion has no choices")
        choice = choices[0]
        logprobs_obj = choice.get("logprobs")
        token_logprobs = logprobs_obj.get("token_logprobs") if isinstance(logprobs_obj, dict) else None
        if (
            not isinstance(logprobs_obj, dict)
            or not isinstance(token_logprobs, list)
            or not all(isinstance(lp, (int, float)) for lp in token_logprobs)
        ):
            raise protocol_error(self.base_url, "the completion has no logprobs.token_logprobs (one per token)")
        logprobs = [float(lp) for lp in token_logprobs]

        ids = choice.get("token_ids")
        if ids is None:
            tokens = logprobs_obj.get("tokens") or []
            ids = [_token_id(token) for token in tokens]
            if any(i is None for i in ids):
                raise protocol_error(
                    self.base_url,
                    "the completion has no token_ids and its logprob tokens "
                    "are not 'token_id:<id>' (return_tokens_as_token_ids)",
                )
        if not isinstance(ids, list) or not all(int_or_none(i) is not None for i in ids):
            raise protocol_error(self.base_url, "token_ids is not a list of ids")
        output_ids = [int(i) for i in ids]

        finish = str(choice.get("finish_reason") or "stop")
        stop_reason = choice.get("stop_reason")
        if (
            finish == "stop"
            and isinstance(stop_reason, int)
            and not isinstance(stop_reason, bool)
            and (not output_ids or output_ids[-1] != stop_reason)
        ):
            output_ids.append(stop_reason)
            if len(logprobs) < len(output_ids):
                logprobs.append(0.0)  # the server dropped the stop token: its logprob is unknown
        if len(logprobs) != len(output_ids):
            raise protocol_error(self.base_url, f"{len(output_ids)} token ids but {len(logprobs)} logprobs")
        return Generation(
            output_ids=output_ids, logprobs=logprobs, finish_reason=finish, weight_version=None, server=self.base_url
        )

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=10, json_answer=False)
        except LLMServerError:
            return False
        return True


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX):
        return int_or_none(token[len(_TOKEN_ID_PREFIX) :])
    return None
