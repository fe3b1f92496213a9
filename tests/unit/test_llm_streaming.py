"""Streamed generation over real HTTP: the reference server streams as SGLang does (cumulative by
default, incremental as an option), the SGLang and vLLM clients join streamed answers into the
Generation the whole answer gives, weight-version changes mid-generation are recorded per token,
and the pool fails over only before the first token."""

from __future__ import annotations

import pytest

from tests.torch_needed import TORCH_MISSING

pytest.importorskip("torch", reason=TORCH_MISSING)

import json
from typing import Any

import aiohttp
from aiohttp import web

from corral.daemon.llm_pool import LLMPool
from corral.rollout.gateway import Gateway
from corral.rollout.llm.client import LLMServerError
from corral.rollout.llm.routing import ROUTING_KEY_HEADER
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.llm.vllm import VLLMClient
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.rollout.reference.tiny import TinyPolicy
from corral.rollout.types import Generation, GenerationDelta, LLMUnavailable, SamplingOptions
from tests.unit.gateway_support import TOK, settings
from tests.unit.test_llm_clients import IM_END_ID, PROMPT, VLLMStandIn, replay_task

REPLAY_PROMPT = TOK.encode_prompt([{"role": "user", "content": "List the files."}])
GREEDY = SamplingOptions(max_new_tokens=12, temperature=0.0)


class Deltas:
    """A DeltaSink that keeps what it was given."""

    def __init__(self) -> None:
        self.deltas: list[GenerationDelta] = []

    def __call__(self, delta: GenerationDelta) -> None:
        self.deltas.append(delta)

    @property
    def ids(self) -> list[int]:
        return [i for d in self.deltas for i in d.ids]

    @property
    def logprobs(self) -> list[float]:
        return [lp for d in self.deltas for lp in d.logprobs]


def assert_same(streamed: Generation, whole: Generation, deltas: Deltas) -> None:
    assert streamed == whole
    assert deltas.ids == whole.output_ids and deltas.logprobs == whole.logprobs
    assert all(len(d.ids) == len(d.logprobs) >= 1 for d in deltas.deltas)


async def raw_events(url: str, body: dict) -> list[Any]:
    async with aiohttp.ClientSession() as http, http.post(url + "/generate", json=body) as response:
        assert response.content_type == "text/event-stream"
        text = await response.text()
    events = [line[6:] for line in text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_reference_server_streams_one_event_per_token_as_sglang(incremental):
    server = ReferenceServer(ReplayPolicy([replay_task()]), incremental_streaming_output=incremental)
    url = await server.start()
    try:
        body = {
            "input_ids": REPLAY_PROMPT,
            "sampling_params": {"max_new_tokens": 200, "stop_token_ids": [IM_END_ID], "skip_special_tokens": False},
            "return_logprob": True,
        }
        events = await raw_events(url, {**body, "stream": True})
        async with aiohttp.ClientSession() as http, http.post(url + "/generate", json=body) as response:
            whole = await response.json()
    finally:
        await server.stop()
    count = len(whole["output_ids"])
    assert len(events) == count and count > 10
    assert [e["meta_info"]["completion_tokens"] for e in events] == list(range(1, count + 1))
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * (count - 1)
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    if incremental:
        assert all(len(e["output_ids"]) == 1 for e in events)
        ids = [i for e in events for i in e["output_ids"]]
        logprobs = [t for e in events for t in e["meta_info"]["output_token_logprobs"]]
        text = "".join(e["text"] for e in events)
    else:
        assert [len(e["output_ids"]) for e in events] == list(range(1, count + 1))
        ids, logprobs, text = (
            events[-1]["output_ids"],
            events[-1]["meta_info"]["output_token_logprobs"],
            events[-1]["text"],
        )
    assert ids == whole["output_ids"] and logprobs == whole["meta_info"]["output_token_logprobs"]
    assert text == whole["text"]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_sglang_client_streamed_equals_whole(incremental):
    """The same generation (the replay policy's, stopped on <|im_end|>; the tiny policy's greedy
    one, cut by length), whole and streamed."""
    for policy, prompt, sampling in (
        (
            ReplayPolicy([replay_task()]),
            REPLAY_PROMPT,
            SamplingOptions(max_new_tokens=200, stop_token_ids=(IM_END_ID,)),
        ),
        (TinyPolicy(seed=0), PROMPT, GREEDY),
    ):
        server = ReferenceServer(policy, incremental_streaming_output=incremental)
        url = await server.start()
        client = SGLangClient(url, timeout_s=10)
        try:
            whole = await client.generate(prompt, sampling)
            deltas = Deltas()
            streamed = await client.generate(prompt, sampling, deltas)
        finally:
            await client.close()
            await server.stop()
        assert_same(streamed, whole, deltas)
        assert len(deltas.deltas) == len(whole.output_ids)  # one per token: they came as generated


class ScriptedStream:
    """A stand-in server that streams scripted events on POST `path` (SGLang's or vLLM's shapes,
    written out here to test the clients' reading of what those engines send), then ends as
    `end` says: "done" (`data: [DONE]`), "drop" (the connection breaks), "error" (an error event).
    `status` other than 200 answers that instead. Records the routing keys it was sent."""

    def __init__(self, path: str, events: list[dict], end: str = "done", status: int = 200) -> None:
        self.path, self.events, self.end, self.status = path, events, end, status
        self.requests = 0
        self.routing_keys: list[str | None] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post(self.path, self.handle)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        self.routing_keys.append(request.headers.get(ROUTING_KEY_HEADER))
        assert (await request.json())["stream"] is True
        if self.status != 200:
            return web.json_response({"error": {"message": "overloaded"}}, status=self.status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in self.events:
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        if self.end == "drop":
            assert request.transport is not None
            request.transport.abort()
            return response
        if self.end == "error":
            await response.write(b'data: {"error": {"message": "engine died", "code": 500}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response


def sglang_events(ids: list[int], labels: list[str], finish: dict, incremental: bool = True) -> list[dict]:
    events = []
    for n in range(1, len(ids) + 1):
        start = n - 1 if incremental else 0
        events.append(
            {
                "output_ids": ids[start:n],
                "meta_info": {
                    "completion_tokens": n,
                    "weight_version": labels[n - 1],
                    "finish_reason": finish if n == len(ids) else None,
                    "output_token_logprobs": [[-0.1 * (i + 1), ids[i], None] for i in range(start, n)],
                },
            }
        )
    return events


async def test_sglang_weight_version_change_mid_generation_is_recorded_per_token():
    events = sglang_events([5, 6, 7, 8], ["3", "3", "4", "4"], {"type": "length", "length": 4})
    server = ScriptedStream("/generate", events)
    url = await server.start()
    client = SGLangClient(url, timeout_s=10)
    try:
        deltas = Deltas()
        generation = await client.generate(PROMPT, SamplingOptions(max_new_tokens=4), deltas)
    finally:
        await client.close()
        await server.stop()
    assert generation.output_ids == [5, 6, 7, 8] and generation.finish_reason == "length"
    assert generation.weight_versions == (3, 3, 4, 4) and generation.weight_version == 3  # the oldest
    assert [d.weight_version for d in deltas.deltas] == [3, 3, 4, 4]


async def test_sglang_stream_puts_back_a_dropped_stop_token_and_refuses_a_stream_that_ends_early():
    events = sglang_events([5, 6], ["1", "1"], {"type": "stop", "matched": IM_END_ID}, incremental=False)
    server = ScriptedStream("/generate", events)
    url = await server.start()
    client = SGLangClient(url, timeout_s=10)
    try:
        deltas = Deltas()
        generation = await client.generate(PROMPT, SamplingOptions(max_new_tokens=8), deltas)
        assert generation.output_ids == [5, 6, IM_END_ID] and deltas.ids == generation.output_ids
        assert client.parse({"output_ids": [5, 6], "meta_info": events[-1]["meta_info"]}) == generation
        server.events = events[:1]  # no event with a finish reason
        with pytest.raises(LLMServerError, match="ended before the generation finished") as info:
            await client.generate(PROMPT, SamplingOptions(max_new_tokens=8), Deltas())
        assert info.value.retryable
        server.end = "error"
        server.events = events
        with pytest.raises(LLMServerError, match="engine died"):
            await client.generate(PROMPT, SamplingOptions(max_new_tokens=8), Deltas())
    finally:
        await client.close()
        await server.stop()


@pytest.mark.parametrize("scale_out", [False, True], ids=["completions", "generate"])
async def test_vllm_client_streamed_equals_whole(scale_out):
    stand_in = VLLMStandIn(scale_out=scale_out)
    stand_in.weight_label, stand_in.relabel_at = "7", 3
    url = await stand_in.start()
    client = VLLMClient(url, timeout_s=10)
    sampling = SamplingOptions(max_new_tokens=10, temperature=0.0, stop_token_ids=(IM_END_ID,))
    try:
        whole = await client.generate(PROMPT, sampling)
        deltas = Deltas()
        streamed = await client.generate(PROMPT, sampling, deltas)
        body = (stand_in.generate_bodies if scale_out else stand_in.bodies)[-1]
        assert body["stream"] is True
    finally:
        await client.close()
        await stand_in.stop()
    assert_same(streamed, whole, deltas)
    assert len(deltas.deltas) == len(whole.output_ids) > 3
    if scale_out:  # the spans say the weights changed at token 3: each token keeps its label
        assert streamed.weight_versions == (7, 7, 7) + (8,) * (len(whole.output_ids) - 3)
        assert streamed.weight_version == 7
    else:
        assert streamed.weight_versions is None and streamed.weight_version is None


@pytest.fixture
async def pool():
    pool = LLMPool(timeout_s=10, backoff_s=0.01, max_backoff_s=0.05, cooldown_s=30, unavailable_wait_s=0.3)
    yield pool
    await pool.close()


async def test_pool_fails_over_a_stream_that_breaks_before_its_first_token(pool):
    broken = ScriptedStream("/generate", [], end="drop")
    refusing = ScriptedStream("/generate", [], status=503)
    good = ReferenceServer(ReplayPolicy([replay_task()]))
    urls = [await broken.start(), await refusing.start(), await good.start()]
    try:
        for url in urls:
            pool.register(url)
        sampling = SamplingOptions(max_new_tokens=200, stop_token_ids=(IM_END_ID,))
        deltas = Deltas()
        generation = await pool.generate(REPLAY_PROMPT, sampling, "r1", on_delta=deltas)
        assert generation.server == good.url and deltas.ids == generation.output_ids
        assert broken.requests == refusing.requests == 1 and good.requests_served == 1
        assert broken.routing_keys == refusing.routing_keys == ["r1"]
        assert {s.address: s.healthy for s in pool.snapshot()} == {urls[0]: False, urls[1]: False, urls[2]: True}
    finally:
        await broken.stop()
        await refusing.stop()
        await good.stop()


async def test_pool_does_not_retry_a_stream_that_breaks_after_its_first_token(pool):
    events = sglang_events([5, 6], ["1", "1"], {"type": "length", "length": 4})
    for event in events:
        event["meta_info"]["finish_reason"] = None  # it breaks before it finishes
    breaking = ScriptedStream("/generate", events, end="drop")
    good = ReferenceServer(ReplayPolicy([replay_task()]))
    urls = [await breaking.start(), await good.start()]
    try:
        for url in urls:
            pool.register(url)
        deltas = Deltas()
        with pytest.raises(LLMUnavailable, match="after streaming part of the reply"):
            await pool.generate(REPLAY_PROMPT, SamplingOptions(max_new_tokens=4), "r1", on_delta=deltas)
        assert deltas.ids == [5, 6]  # what was passed on stays the only thing passed on
        assert breaking.requests == 1 and good.requests_served == 0
        snapshot = {s.address: s for s in pool.snapshot()}
        assert not snapshot[urls[0]].healthy and snapshot[urls[0]].failures == 1
    finally:
        await breaking.stop()
        await good.stop()


async def test_gateway_streams_through_the_pool_token_exact(pool):
    """The daemon's path: the gateway over LLMPool over the reference server, streamed; the
    sample is exact and its ids and logprobs are those of the same call made whole."""
    import openai

    server = ReferenceServer(ReplayPolicy([replay_task()]), per_token_latency_s=0.001)
    pool.register(await server.start())
    gateway = Gateway(pool.generate, TOK, context_length=pool.context_length)
    url = await gateway.listen_tcp()
    try:
        outcomes = []
        for stream in (False, True):
            session = gateway.open_session(f"r-{stream}", settings())
            client = openai.AsyncOpenAI(base_url=url, api_key=session.key)
            messages = [{"role": "user", "content": "List the files."}]
            if stream:
                chunks = [
                    c async for c in await client.chat.completions.create(model="m", messages=messages, stream=True)
                ]
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            else:
                content = (
                    (await client.chat.completions.create(model="m", messages=messages)).choices[0].message.content
                )
            outcomes.append((content, gateway.close_session(session.key)))
    finally:
        await gateway.close()
        await server.stop()
    (whole_content, whole), (streamed_content, streamed) = outcomes
    assert streamed_content == whole_content and "<tool_call>" in streamed_content
    (whole_sample,), (streamed_sample,) = whole.samples, streamed.samples
    assert (
        streamed_sample.prompt_ids + streamed_sample.response_ids == whole_sample.prompt_ids + whole_sample.response_ids
    )
    assert streamed_sample.response_logprobs == whole_sample.response_logprobs
    assert streamed_sample.weight_versions == whole_sample.weight_versions
