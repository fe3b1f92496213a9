"""Token-in/token-out client for SGLang's native POST /generate.

Request: {"input_ids", "sampling_params": {max_new_tokens, temperature, top_p, top_k, stop,
stop_token_ids, skip_special_tokens: false, no_stop_trim: true}, "return_logprob": true,
"logprob_start_len": -1, "stream": false}.

Response: "output_ids", and "meta_info" with "output_token_logprobs" ([logprob, id, text] per
generated token), "finish_reason" ({"type": "stop" | "length" | "abort", "matched": ...}) and
"weight_version" (a string), plus "weight_versions" spans in recent releases.

Streamed ("stream": true): server-sent events `data: {"text", "output_ids", "meta_info"}`, then
`data: [DONE]`. By default each event carries everything so far (output_ids and
meta_info.output_token_logprobs cumulative); a server started with --incremental-streaming-output
sends only the new ones. meta_info.completion_tokens (the count so far, in both modes) tells which.
The last event has the finish reason. The client joins the events into the whole answer and reads
it as a whole one; each event's meta_info.weight_version labels its new ids, so a generation
whose weights changed midway gets a weight version per token (whole, only the last label is known).

The stop token: SGLang's "output_ids" (and "output_token_logprobs") keep the token generation
stopped on; only the text is trimmed, and no_stop_trim keeps that too. Should a server return ids
without it all the same (finish "stop" with an int "matched" that is not the last id), the client
appends the matched id; its logprob comes from output_token_logprobs when that has one more entry
for it, else it is unknown and recorded as 0.0.
"""

from __future__ import annotations

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


class SGLangClient(HTTPClientBase):
    """One SGLang server (or anything speaking its /generate, like the built-in reference server).
    Every failure raises LLMServerError (see client.py for which are retryable)."""

    protocol = "sglang"

    def __init__(
        self, base_url: str, *, session: aiohttp.ClientSession | None = None, timeout_s: float = 600.0
    ) -> None:
        super().__init__(base_url, session=session, timeout_s=timeout_s)

    def request_body(self, input_ids: list[int], sampling: SamplingOptions, stream: bool = False) -> dict[str, Any]:
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
            "stream": stream,
        }

    async def generate(
        self, input_ids: list[int], sampling: SamplingOptions, on_delta: DeltaSink | None = None
    ) -> Generation:
        if on_delta is not None:
            return await self._generate_streamed(input_ids, sampling, on_delta)
        data = await self._request("POST", "/generate", self.request_body(input_ids, sampling))
        return self.parse(data)

    async def _generate_streamed(
        self, input_ids: list[int], sampling: SamplingOptions, on_delta: DeltaSink
    ) -> Generation:
        ids: list[int] = []
        triples: list[Any] = []
        labels: list[int | None] = []  # the weight version each id came labelled with
        meta: dict[str, Any] = {}
        async for event in self._stream("/generate", self.request_body(input_ids, sampling, stream=True)):
            if isinstance(event, list) and len(event) == 1:
                event = event[0]
            if not isinstance(event, dict) or not isinstance(event.get("meta_info"), dict):
                raise protocol_error(self.base_url, "a streamed /generate event has no meta_info")
            meta = event["meta_info"]
            new_ids = self._new_entries(event.get("output_ids"), ids, meta, "output_ids")
            new_triples = self._new_entries(meta.get("output_token_logprobs"), triples, meta, "output_token_logprobs")
            if len(new_triples) != len(new_ids):
                raise protocol_error(
                    self.base_url, f"a streamed event adds {len(new_ids)} ids but {len(new_triples)} logprobs"
                )
            part = self.parse({"output_ids": new_ids, "meta_info": {"output_token_logprobs": new_triples}})
            ids += new_ids
            triples += new_triples
            label = int_or_none(meta.get("weight_version"))
            labels += [label] * len(new_ids)
            if new_ids:
                on_delta(GenerationDelta(part.output_ids, part.logprobs, label))
        if meta.get("finish_reason") is None:
            raise protocol_error(self.base_url, "the /generate stream ended before the generation finished")
        generation = self.parse({"output_ids": ids, "meta_info": {**meta, "output_token_logprobs": triples}})
        if len(generation.output_ids) > len(ids):  # the stop token the server dropped, put back
            on_delta(GenerationDelta(generation.output_ids[len(ids) :], generation.logprobs[len(ids) :]))
            labels += [labels[-1] if labels else None] * (len(generation.output_ids) - len(ids))
        if not meta.get("weight_versions") and len(set(labels)) > 1 and None not in labels:
            per_token = tuple(label for label in labels if label is not None)
            generation = dataclasses.replace(generation, weight_version=min(per_token), weight_versions=per_token)
        return generation

    def _new_entries(self, entries: Any, received: list[Any], meta: dict[str, Any], name: str) -> list[Any]:
        """The entries of a streamed event's list that are new: all of them when the server
        streams incrementally, those past `received` when it repeats everything so far."""
        if entries is None:
            entries = []
        if not isinstance(entries, list):
            raise protocol_error(self.base_url, f"{name} of a streamed event is not a list")
        total = int_or_none(meta.get("completion_tokens"))
        cumulative = len(entries) >= len(received) and entries[: len(received)] == received
        if total is not None:
            if len(entries) == total and cumulative:
                return entries[len(received) :]
            if len(received) + len(entries) == total:
                return entries
            raise protocol_error(
                self.base_url, f"a streamed event has {len(entries)} {name} after {len(received)}, of {total} in all"
            )
        return entries[len(received) :] if cumulative and received else entries

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
            weight_versions=token_weight_versions(meta.get("weight_versions"), len(output_ids)),
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
