"""Token-in/token-out client for SGLang's native POST /generate.

Request: {"input_ids", "sampling_params": {max_new_tokens, temperature, top_p, top_k, stop,
stop_token_ids, skip_special_tokens: false, no_stop_trim: true}, "return_logprob": true,
"logprob_start_len": -1, "stream": false}.

Response: "output_ids", and "meta_info" with "output_token_logprobs" ([logprob, id, text] per
generated token), "finish_reason" ({"type": "stop" | "length" | "abort", "matched": ...}) and
"weight_version" (a string), plus "weight_versions" spans in recent releases.

The stop token: SGLang's "output_ids" (and "output_token_logprobs") keep the token generation
stopped on; only the text is trimmed, and no_stop_trim keeps that too. Should a server return ids
without it all the same (finish "stop" with an int "matched" that is not the last id), the client
appends the matched id; its logprob comes from output_token_logprobs when that has one more entry
for it, else it is unknown and recorded as 0.0.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from corral.rollout.llm.client import (
    HTTPClientBase,
    LLMServerError,
    int_or_none,
    optional_sampling_fields,
    protocol_error,
    weight_version,
)
from corral.rollout.types import Generation, SamplingOptions


class SGLangClient(HTTPClientBase):
    """One SGLang server (or anything speaking its /generate, like the built-in reference server).
    Every failure raises LLMServerError (see client.py for which are retryable)."""

    protocol = "sglang"

    def __init__(
        self, base_url: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 600.0
    ) -> None:
        super().__init__(base_url, session=session, timeout_s=timeout_s)

    def request_body(self, input_ids: list[int], sampling: SamplingOptions) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        params.update(optional_sampling_fields(sampling))
        return {
            "input_ids": list(input_ids),
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }

    async def generate(self, input_ids: list[int], sampling: SamplingOptions) -> Generation:
        data = await self._request("POST", "/generate", self.request_body(input_ids, sampling))
        return self.parse(data)

    def parse(self, data: Any) -> Generation:
        """A Generation from /generate's JSON answer; LLMServerError when it lacks ids or logprobs."""
        if isinstance(data, list) and len(data) == 1:
            data = data[0]
        if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
            raise protocol_error(self.base_url, "the /generate answer has no meta_info")
        meta = data["meta_info"]
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise protocol_error(self.base_url, "the /generate answer has no meta_info.output_token_logprobs")
        logprobs: list[float] = []
        logprob_ids: list[int] = []
        for entry in triples:
            if (
                not isinstance(entry, (list, tuple))
                or len(entry) < 2
                or not isinstance(entry[0], (int, float))
                or int_or_none(entry[1]) is None
            ):
                raise protocol_error(self.base_url, f"bad output_token_logprobs entry {entry!r}")
            logprobs.append(float(entry[0]))
            logprob_ids.append(int(entry[1]))
        output_ids = data.get("output_ids")
        if output_ids is None:
            output_ids = list(logprob_ids)
        if not isinstance(output_ids, list) or not all(int_or_none(i) is not None for i in output_ids):
            raise protocol_error(self.base_url, "output_ids is not a list of ids")
        output_ids = [int(i) for i in output_ids]

        reason = meta.get("finish_reason")
        kind = reason.get("type") if isinstance(reason, dict) else reason
        finish = str(kind) if kind else "stop"
        matched = reason.get("matched") if isinstance(reason, dict) else None
        if (
            finish == "stop"
            and isinstance(matched, int)
            and not isinstance(matched, bool)
            and (not output_ids or output_ids[-1] != matched)
        ):
            output_ids.append(matched)
            if len(logprobs) < len(output_ids):
                logprobs.append(0.0)  # the server dropped the stop token: its logprob is unknown
                logprob_ids.append(matched)

        if len(logprobs) != len(output_ids):
            raise protocol_error(self.base_url, f"{len(output_ids)} output ids but {len(logprobs)} logprobs")
        if logprob_ids != output_ids:
            raise protocol_error(self.base_url, "output_token_logprobs name other ids than output_ids")
        return Generation(
            output_ids=output_ids,
            logprobs=logprobs,
            finish_reason=finish,
            weight_version=weight_version(meta),
            server=self.base_url,
        )

    async def get_weight_version(self) -> int | None:
        """GET /get_weight_version (falling back to /get_model_info): the served version as an int,
        None when the server reports none or a non-integer one."""
        try:
            data = await self._request("GET", "/get_weight_version", timeout_s=30)
        except LLMServerError as error:
            if error.status != 404:
                raise
            data = await self._request("GET", "/get_model_info", timeout_s=30)
        return int_or_none(data.get("weight_version")) if isinstance(data, dict) else None

    async def health(self) -> bool:
        """GET /health answers 200."""
        try:
            await self._request("GET", "/health", timeout_s=10, json_answer=False)
        except LLMServerError:
            return False
        return True
