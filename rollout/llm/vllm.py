"""Token-in/token-out client for vLLM: its token-in/token-out POST /inference/v1/generate where the
server offers it (vLLM started with --enable-scale-out), else the OpenAI-compatible POST
/v1/completions. The first generation finds out which (403 or 404 from /inference/v1/generate:
completions from then on).

/inference/v1/generate: {"model", "token_ids": [ids], "sampling_params": {max_tokens, temperature,
top_p, top_k, stop, stop_token_ids, "logprobs": 0, skip_special_tokens: false,
include_stop_str_in_output: true}, "stream": false}; choices[0] with "token_ids",
"logprobs": {"content": [{"token_id", "logprob"}, ...]}, "finish_reason", "stop_reason" and
"weight_versions" spans ([{"version", "start", "end"}]: the label the weights had while each token
was sampled, set by the trainer through vLLM's /update_weight_version or /finish_weight_update).
An integer label is the generation's weight version (the oldest, when it changed mid-generation);
vLLM's unlabelled "default" is none, and the daemon's policy version stands in.

/v1/completions request: {"model", "prompt": [ids], "max_tokens", "temperature", "top_p", "top_k", "stop",
"stop_token_ids", "logprobs": 1, "return_token_ids": true, "return_tokens_as_token_ids": true,
"skip_special_tokens": false, "include_stop_str_in_output": true, "n": 1, "stream": false}.

Response: choices[0] with "token_ids" (vLLM >= 0.10.2 with return_token_ids; older releases:
read from logprobs.tokens, which return_tokens_as_token_ids writes as "token_id:<id>"),
"logprobs": {"token_logprobs": [...]}, "finish_reason" ("stop" | "length" | "abort") and
"stop_reason" (the stop token id, the stop string, or null for EOS).

vLLM's token ids keep the token generation stopped on; should a server drop it all the same
(finish "stop", an int stop_reason that is not the last id), the client appends it with logprob
0.0 (unknown). /v1/completions reports no weight version: Generation.weight_version is None.

Logprobs: vLLM returns those of the model's raw distribution (before temperature, top-k and top-p)
unless it runs with --logprobs-mode processed_logprobs. A sampling that reshapes the distribution
needs processed ones; the client probes the server once (`logprobs_mode`) and refuses such a
sampling from a server that returns anything else (LLMServerError, not retryable).

Streamed (a DeltaSink given): the same requests with "stream": true (and, for /v1/completions,
"stream_options": {"include_usage": false}). Each server-sent event's choices[0] carries the new
"token_ids" and their logprobs (logprobs.content on /inference/v1/generate, logprobs.token_logprobs
on /v1/completions); the last has the finish and stop reasons, and on /inference/v1/generate the
"weight_versions" spans of the whole output. The client joins them into the whole answer's choice
and reads that as a whole one, so both modes give the same Generation. With spans, every token
gets its label (Generation.weight_versions) in either mode.

The model name: the one given, else the first of GET /v1/models (asked once). The context window:
that entry's "max_model_len" (`context_length`), which the agent loop keeps every request within.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp

from corral.rollout.llm.client import (
    HTTPClientBase,
    LLMServerError,
    int_or_none,
    optional_sampling_fields,
    protocol_error,
    token_weight_versions,
    weight_version,
)
from corral.rollout.types import DeltaSink, Generation, GenerationDelta, SamplingOptions

_TOKEN_ID_PREFIX = "token_id:"
GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"

# What vLLM's logprobs are (its --logprobs-mode), as the probe in `logprobs_mode` tells them apart.
PROCESSED_LOGPROBS = "processed_logprobs"  # of the sampling distribution: what a trainer needs
RAW_LOGPROBS = "raw_logprobs"  # of the model's distribution before temperature, top-k, top-p
LOGITS = "logits"  # raw_logits or processed_logits: not log-probabilities at all


class VLLMClient(HTTPClientBase):
    """One vLLM server. Every failure raises LLMServerError (see client.py)."""

    protocol = "vllm"

    def __init__(
        self, base_url: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 600.0, model: str = ""
    ) -> None:
        super().__init__(base_url, session=session, timeout_s=timeout_s)
        self.model = model
        self._model_lock = asyncio.Lock()
        self._logprobs_mode: str | None = None
        self._probe_lock = asyncio.Lock()
        # Whether the server offers GENERATE_PATH (None: not known until the first generation).
        self.token_endpoint: bool | None = None

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

    async def logprobs_mode(self) -> str:
        """Which logprobs the server returns, found once by a probe: two tokens at temperature 1
        with top_k 1, where the sampling distribution keeps one token, so its processed logprobs
        are exactly 0.0, raw logprobs (the model's own) are below 0, and logits are anything."""
        async with self._probe_lock:  # one probe, whoever asks while it runs
            if self._logprobs_mode is None:
                model = await self.resolve_model()
                body = self.request_body(model, [0], SamplingOptions(max_new_tokens=2, temperature=1.0, top_k=1))
                # The probe is a generation like any other: on a busy engine it waits its turn behind
                # the queue, so it gets a generation's timeout (a shorter one took a busy server out
                # of rotation and probed it again).
                values = self.parse(await self._request("POST", COMPLETIONS_PATH, body)).logprobs
                if values and all(value == 0.0 for value in values):
                    self._logprobs_mode = PROCESSED_LOGPROBS
                elif all(value <= 0.0 for value in values):
                    self._logprobs_mode = RAW_LOGPROBS
                else:
                    self._logprobs_mode = LOGITS
            return self._logprobs_mode

    async def check_logprobs(self, sampling: SamplingOptions) -> None:
        """Refuses (not retryable) to generate with a sampling that reshapes the distribution
        (temperature other than 0 or 1, top-p, top-k) from a server whose logprobs are not those
        of the sampling distribution: a trainer would take them for the behaviour policy's."""
        reshaped = sampling.temperature > 0 and (
            sampling.temperature != 1.0 or sampling.top_p < 1.0 or sampling.top_k > 0
        )
        if not reshaped:
            return  # raw and processed logprobs are the same thing
        mode = await self.logprobs_mode()
        if mode != PROCESSED_LOGPROBS:
            raise LLMServerError(
                f"{self.base_url} returns {mode.replace('_', ' ')}, not the logprobs of the sampling distribution "
                f"(temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, top_k {sampling.top_k}): "
                "start vLLM with --logprobs-mode processed_logprobs",
                server=self.base_url,
                retryable=False,
            )

    def generate_body(self, model: str, input_ids: list[int], sampling: SamplingOptions) -> dict[str, Any]:
        params: dict[str, Any] = {
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,  # the sampled token's only
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
            "n": 1,
        }
        params.update(optional_sampling_fields(sampling))
        return {"model": model, "token_ids": list(input_ids), "sampling_params": params, "stream": False}

    async def generate(
        self, input_ids: list[int], sampling: SamplingOptions, on_delta: DeltaSink | None = None
    ) -> Generation:
        model = await self.resolve_model()
        await self.check_logprobs(sampling)
        if self.token_endpoint is not False:
            body = self.generate_body(model, input_ids, sampling)
            try:
                if on_delta is None:
                    generation = self.parse_generate(await self._request("POST", GENERATE_PATH, body))
                else:
                    generation = await self._streamed(GENERATE_PATH, {**body, "stream": True}, on_delta, _generate_part)
            except LLMServerError as error:
                # 403: scale-out endpoints disabled; 404/405: a vLLM without them (also when a
                # concurrent first generation found that out already).
                if self.token_endpoint is True or error.status not in (403, 404, 405):
                    raise
                self.token_endpoint = False
            else:
                self.token_endpoint = True
                return generation
        body = self.request_body(model, input_ids, sampling)
        if on_delta is None:
            return self.parse(await self._request("POST", COMPLETIONS_PATH, body))
        body = {**body, "stream": True, "stream_options": {"include_usage": False}}
        return await self._streamed(COMPLETIONS_PATH, body, on_delta, _completion_part)

    async def _streamed(self, path: str, body: dict[str, Any], on_delta: DeltaSink, part: Any) -> Generation:
        """Generates streamed: passes each event's new ids on, joins the events' choices into
        the whole answer's (`part` reads one event's ids and logprob entries) and parses that."""
        ids: list[int] = []
        entries: list[Any] = []
        last: dict[str, Any] = {}
        spans: Any = None
        async for event in self._stream(path, body):
            choices = event.get("choices") if isinstance(event, dict) else None
            if not choices:  # a usage event
                continue
            choice = self._first_choice(event)
            new_ids, new_entries = part(self, choice)
            if new_ids or new_entries:
                new = self._joined(path, new_ids, new_entries, {})  # checks them as a whole answer would
                on_delta(GenerationDelta(new.output_ids, new.logprobs))
            ids += new_ids
            entries += new_entries
            last = choice
            spans = choice.get("weight_versions") or spans
        if last.get("finish_reason") is None:
            raise protocol_error(self.base_url, f"the {path} stream ended before the generation finished")
        generation = self._joined(path, ids, entries, {**last, "weight_versions": spans})
        if len(generation.output_ids) > len(ids):  # the stop token the server dropped, put back
            on_delta(GenerationDelta(generation.output_ids[len(ids) :], generation.logprobs[len(ids) :]))
        return generation

    def _joined(self, path: str, ids: list[int], entries: list[Any], last: dict[str, Any]) -> Generation:
        """The Generation of the whole answer whose choice has these ids and logprob entries."""
        choice = {key: value for key, value in last.items() if key not in ("token_ids", "logprobs", "text")}
        choice["token_ids"] = ids
        if path == GENERATE_PATH:
            choice["logprobs"] = {"content": entries}
            return self.parse_generate({"choices": [choice]})
        choice["logprobs"] = {"token_logprobs": entries}
        return self.parse({"choices": [choice]})

    def parse_generate(self, data: Any) -> Generation:
        """A Generation from /inference/v1/generate's answer (weight version from its spans)."""
        choice = self._first_choice(data)
        content = choice.get("logprobs", {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
        if not isinstance(content, list) or not all(
            isinstance(entry, dict) and isinstance(entry.get("logprob"), (int, float)) for entry in content
        ):
            raise protocol_error(self.base_url, "the generation has no logprobs.content (one per token)")
        ids = choice.get("token_ids")
        if not isinstance(ids, list) or not all(int_or_none(i) is not None for i in ids):
            raise protocol_error(self.base_url, "token_ids is not a list of ids")
        if [int_or_none(entry.get("token_id")) for entry in content] != [int(i) for i in ids]:
            raise protocol_error(self.base_url, "logprobs.content names other ids than token_ids")
        generation = self._generation(
            [int(i) for i in ids],
            [float(entry["logprob"]) for entry in content],
            choice,
            weight_version({"weight_versions": choice.get("weight_versions")}),
        )
        per_token = token_weight_versions(choice.get("weight_versions"), len(generation.output_ids))
        return dataclasses.replace(generation, weight_versions=per_token) if per_token else generation

    def parse(self, data: Any) -> Generation:
        """A Generation from /v1/completions' answer."""
        choice = self._first_choice(data)
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
        return self._generation([int(i) for i in ids], logprobs, choice, None)

    def _first_choice(self, data: Any) -> dict[str, Any]:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise protocol_error(self.base_url, "the answer has no choices")
        return choices[0]

    def _generation(
        self, output_ids: list[int], logprobs: list[float], choice: dict[str, Any], version: int | None
    ) -> Generation:
        """The Generation of a choice's ids and logprobs, with the stop token put back where the
        server dropped it."""
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
            output_ids=output_ids, logprobs=logprobs, finish_reason=finish, weight_version=version, server=self.base_url
        )

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=10, json_answer=False)
        except LLMServerError:
            return False
        return True


def _generate_part(client: VLLMClient, choice: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """One /inference/v1/generate event's new ids and logprobs.content entries."""
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return _ids(client, choice.get("token_ids")), list(content or [])


def _completion_part(client: VLLMClient, choice: dict[str, Any]) -> tuple[list[int], list[Any]]:
    """One /v1/completions event's new ids and token_logprobs."""
    logprobs = choice.get("logprobs")
    values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    ids = choice.get("token_ids")
    if ids is None and isinstance(logprobs, dict):  # before return_token_ids: "token_id:<id>" tokens
        ids = [_token_id(token) for token in logprobs.get("tokens") or []]
    return _ids(client, ids), list(values or [])


def _ids(client: VLLMClient, ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(int_or_none(i) is not None for i in ids):
        raise protocol_error(client.base_url, "a streamed event's token_ids is not a list of ids")
    return [int(i) for i in ids]


def _token_id(token: Any) -> int | None:
    if isinstance(token, str) and token.startswith(_TOKEN_ID_PREFIX):
        return int_or_none(token[len(_TOKEN_ID_PREFIX) :])
    return None
