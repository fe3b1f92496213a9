"""LLM clients and the server pool over real HTTP: the SGLang client against the built-in
reference server, the vLLM client against a stand-in of vLLM's completions endpoint, and the
pool's stickiness, load balancing, failover, cool-down and run-time registration."""

from __future__ import annotations

import pytest

from tests.torch_needed import TORCH_MISSING

pytest.importorskip("torch", reason=TORCH_MISSING)

import asyncio
import json
import math
import time
from typing import Any

import torch
from aiohttp import ClientSession, web

from corral.daemon.llm_pool import LLMPool, ServerAlreadyRegistered, UnknownServer
from corral.rollout.agent_loop import AgentLimits, AgentLoop
from corral.rollout.llm.client import LLMRequestRejected, LLMServerError
from corral.rollout.llm.routing import ROUTING_KEY_HEADER
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.llm.vllm import VLLMClient
from corral.rollout.reference.policies import GenerateParams, PolicyOutput
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.rollout.reference.tiny import TinyPolicy, truncated
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat
from corral.rollout.types import FinishReason, LLMUnavailable, SamplingOptions
from corral.sdk.errors import InvalidArgument
from corral.v1 import rollout_pb2 as pb

TOK = ByteChatTokenizer()
IM_END_ID = TOK.special_ids["<|im_end|>"]
PROMPT = TOK.encode_prompt([{"role": "user", "content": "Write something."}])
SHORT = SamplingOptions(max_new_tokens=4, temperature=1.0)


def replay_task() -> pb.Task:
    task = pb.Task(task_id="t1")
    task.prompt.messages.add(role="user", content="List the files.")
    task.reference_solution.add(name="bash", arguments_json='{"command": "ls"}')
    return task


# ---- SGLang ---------------------------------------------------------------------------------------


async def test_sglang_client_round_trip_against_the_reference_server(tmp_path):

    from corral.rollout.reference.tiny_model import TinyByteLM

    policy = TinyPolicy(seed=0)
    server = ReferenceServer(policy)
    url = await server.start()
    client = SGLangClient(url, timeout_s=10)
    try:
        generation = await client.generate(PROMPT, SamplingOptions(max_new_tokens=12, temperature=0.7))
        assert generation.server == url
        assert 1 <= len(generation.output_ids) <= 12
        assert len(generation.logprobs) == len(generation.output_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in generation.logprobs)
        assert all(0 <= i < TOK.vocab_size for i in generation.output_ids)
        assert generation.weight_version == 0
        assert generation.finish_reason in ("stop", "length")
        if generation.finish_reason == "length":
            assert len(generation.output_ids) == 12
        # The weight version follows the server's.
        torch.save(TinyByteLM().state_dict(), tmp_path / "w.pt")
        await policy.load_weights(str(tmp_path / "w.pt"), 5)
        assert (await client.generate(PROMPT, SHORT)).weight_version == 5
        assert await client.get_weight_version() == 5
        assert await client.health()
    finally:
        await client.close()
        await server.stop()


async def test_sglang_client_keeps_the_stop_token():
    server = ReferenceServer(ReplayPolicy([replay_task()]))
    url = await server.start()
    client = SGLangClient(url, timeout_s=10)
    try:
        prompt = TOK.encode_prompt([{"role": "user", "content": "List the files."}])
        generation = await client.generate(prompt, SamplingOptions(max_new_tokens=200, stop_token_ids=(IM_END_ID,)))
        assert generation.finish_reason == "stop"
        assert generation.output_ids[-1] == IM_END_ID
        assert (
            TOK.decode(generation.output_ids)
            == '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call><|im_end|>'
        )
    finally:
        await client.close()
        await server.stop()


def test_sglang_parse_appends_a_dropped_stop_token_and_rejects_missing_logprobs():
    client = SGLangClient("http://127.0.0.1:1")
    answer = {
        "output_ids": [10, 11],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": IM_END_ID},
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, 10, None], [-0.25, 11, None]],
        },
    }
    generation = client.parse(answer)
    assert generation.output_ids == [10, 11, IM_END_ID]
    assert generation.logprobs == [-0.5, -0.25, 0.0]  # the dropped token's logprob is unknown
    assert generation.weight_version == 3 and generation.finish_reason == "stop"
    # When the logprobs still name it, its logprob is kept.
    answer["meta_info"]["output_token_logprobs"].append([-0.125, IM_END_ID, None])
    assert client.parse(answer).logprobs == [-0.5, -0.25, -0.125]
    # Weight versions that are not integers are None; spans give the oldest.
    answer["meta_info"]["weight_version"] = "step-9"
    assert client.parse(answer).weight_version is None
    answer["meta_info"]["weight_versions"] = [
        {"version": "4", "start": 0, "end": 1},
        {"version": "5", "start": 1, "end": 3},
    ]
    assert client.parse(answer).weight_version == 4
    assert client.parse(answer).weight_versions == (4, 5, 5)  # and each token keeps its own
    del answer["meta_info"]["output_token_logprobs"]
    with pytest.raises(LLMServerError, match="output_token_logprobs"):
        client.parse(answer)
    with pytest.raises(LLMServerError, match="2 output ids but 1 logprobs"):
        client.parse(
            {
                "output_ids": [1, 2],
                "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-1.0, 1, None]]},
            }
        )


# ---- vLLM -------------------------------------------------------------------------------------------


class VLLMStandIn:
    """A stand-in for vLLM's OpenAI-compatible server, because vLLM itself cannot run here (no GPU):
    GET /v1/models and POST /v1/completions with a token-id prompt, shaped as vLLM answers
    (choices[0].token_ids with return_token_ids, logprobs.tokens as "token_id:<id>",
    finish_reason and stop_reason), generating with the tiny policy. With `old=True` it answers
    like vLLM before 0.10.2 (no token_ids field). Its context window is `max_model_len`, kept as
    vLLM keeps it: max_tokens is cut to the room left, a prompt that fills it is refused (400).
    Its logprobs are those vLLM returns in `logprobs_mode`: "processed_logprobs" (of the sampling
    distribution: temperature, top-k, top-p) or "raw_logprobs" (of the model's distribution).
    POST /inference/v1/generate answers 403 as vLLM does unless `scale_out`, then generates with
    `weight_label` as the weight version of every token (from token `relabel_at` on,
    `weight_label` + 1: the weights changed mid-generation). With "stream": true both answer as
    vLLM 0.32 streams: one event per token with its id and logprob, the finish and stop reasons
    (and on /inference/v1/generate the weight-version spans of the whole output) on the last."""

    def __init__(
        self,
        old: bool = False,
        max_model_len: int = 1 << 16,
        logprobs_mode: str = "processed_logprobs",
        scale_out: bool = False,
    ) -> None:
        self.policy = TinyPolicy(seed=1)
        self.old = old
        self.max_model_len = max_model_len
        self.logprobs_mode = logprobs_mode
        self.scale_out = scale_out
        self.weight_label = "default"
        self.relabel_at: int | None = None
        self.generate_bodies: list[dict] = []
        self.bodies: list[dict] = []
        self.models_asked = 0
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/inference/v1/generate", self.generate_tokens)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self.runner is not None  # start() made it
        await self.runner.cleanup()

    async def models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        entry = {"id": "tiny-byte-lm", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [entry]})

    def refusal(self, model: str | None, prompt: list[int]) -> web.Response | None:
        if model != "tiny-byte-lm":
            return web.json_response({"object": "error", "message": "model not found", "code": 404}, status=404)
        if len(prompt) >= self.max_model_len:
            message = f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length"
            return web.json_response({"object": "error", "message": message, "code": 400}, status=400)
        return None

    async def sample(self, prompt: list[int], fields: dict) -> PolicyOutput:
        params = GenerateParams(
            max_new_tokens=min(fields["max_tokens"], self.max_model_len - len(prompt)),
            temperature=fields.get("temperature", 1.0),
            top_p=fields.get("top_p", 1.0),
            top_k=fields.get("top_k", -1),
            stop_token_ids=tuple(fields.get("stop_token_ids", ())),
            seed=fields.get("seed"),
        )
        out = await self.policy.generate(prompt, params)
        return out._replace(logprobs=self.recomputed_logprobs(prompt, out.output_ids, params))

    async def generate_tokens(self, request: web.Request) -> web.StreamResponse:
        """POST /inference/v1/generate, as vLLM answers it with and without --enable-scale-out."""
        if not self.scale_out:
            message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
            return web.json_response({"error": {"message": message, "code": 403}}, status=403)
        body = await request.json()
        self.generate_bodies.append(body)
        refused = self.refusal(body.get("model"), body["token_ids"])
        if refused is not None:
            return refused
        fields = body["sampling_params"]
        out = await self.sample(body["token_ids"], fields)
        choice: dict[str, Any] = {
            "index": 0,
            "token_ids": out.output_ids,
            "logprobs": {"content": [{"token_id": i, "logprob": lp} for i, lp in zip(out.output_ids, out.logprobs)]},
            "finish_reason": out.finish_reason,
            "stop_reason": out.matched if out.matched in fields.get("stop_token_ids", ()) else None,
            "weight_versions": self.spans(len(out.output_ids)),
        }
        if body.get("stream"):

            def generate_event(i: int, last: bool) -> dict:
                event = {
                    "index": 0,
                    "token_ids": out.output_ids[i : i + 1],
                    "logprobs": {"content": choice["logprobs"]["content"][i : i + 1]},
                    "finish_reason": choice["finish_reason"] if last else None,
                    "stop_reason": choice["stop_reason"] if last else None,
                    "weight_versions": choice["weight_versions"] if last else None,
                }
                return {"request_id": "gen-1", "output_mode": "tokens", "choices": [event]}

            return await self.stream(request, len(out.output_ids), generate_event)
        return web.json_response({"request_id": "gen-1", "choices": [choice]})

    def spans(self, count: int) -> list[dict]:
        change = count if self.relabel_at is None else min(self.relabel_at, count)
        spans = [{"version": self.weight_label, "start": 0, "end": change}]
        if change < count:
            spans.append({"version": str(int(self.weight_label) + 1), "start": change, "end": count})
        return spans

    async def stream(self, request: web.Request, count: int, event: Any) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(count):
            await response.write(f"data: {json.dumps(event(i, i == count - 1))}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        refused = self.refusal(body.get("model"), body["prompt"])
        if refused is not None:
            return refused
        out = await self.sample(body["prompt"], body)
        choice: dict[str, Any] = {
            "index": 0,
            "text": TOK.decode(out.output_ids),
            "logprobs": {
                "tokens": [f"token_id:{i}" for i in out.output_ids],
                "token_logprobs": out.logprobs,
                "text_offset": [0] * len(out.output_ids),
                "top_logprobs": [{f"token_id:{i}": lp} for i, lp in zip(out.output_ids, out.logprobs)],
            },
            "finish_reason": out.finish_reason,
            "stop_reason": out.matched if out.matched in body.get("stop_token_ids", ()) else None,
        }
        if not self.old:
            choice["token_ids"] = out.output_ids
            choice["prompt_token_ids"] = body["prompt"]
        if body.get("stream"):
            logprobs = choice["logprobs"]

            def completion_event(i: int, last: bool) -> dict:
                event = {
                    "index": 0,
                    "text": TOK.decode(out.output_ids[i : i + 1]),
                    "logprobs": {key: logprobs[key][i : i + 1] for key in ("tokens", "token_logprobs", "top_logprobs")},
                    "finish_reason": choice["finish_reason"] if last else None,
                    "stop_reason": choice["stop_reason"] if last else None,
                }
                if not self.old:
                    event["token_ids"] = out.output_ids[i : i + 1]
                return {"id": "cmpl-1", "object": "text_completion", "choices": [event]}

            return await self.stream(request, len(out.output_ids), completion_event)
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": body["model"],
                "choices": [choice],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(out.output_ids)},
            }
        )

    def recomputed_logprobs(self, prompt: list[int], output_ids: list[int], params: GenerateParams) -> list[float]:
        return stand_in_logprobs(self.policy, prompt, output_ids, params, self.logprobs_mode)


def stand_in_logprobs(
    policy: TinyPolicy, prompt: list[int], output_ids: list[int], params: GenerateParams, mode: str
) -> list[float]:
    """The logprobs of `output_ids` as vLLM reports them in logprobs mode `mode`."""
    from torch.nn import functional as F

    with torch.no_grad():
        logits, _ = policy.model(torch.tensor([prompt + output_ids]))
    rows = logits[0, len(prompt) - 1 : -1].float()
    if mode == "processed_logprobs" and params.temperature > 0:
        rows = torch.stack([truncated(row / params.temperature, params.top_k, params.top_p) for row in rows])
    return F.log_softmax(rows, -1).gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1).tolist()


@pytest.mark.parametrize("old", [False, True], ids=["token_ids", "logprob_tokens"])
async def test_vllm_client_against_a_completions_stand_in(old):
    stand_in = VLLMStandIn(old=old)
    url = await stand_in.start()
    client = VLLMClient(url, timeout_s=10)
    try:
        first = await client.generate(PROMPT, SamplingOptions(max_new_tokens=16, temperature=0.9, top_k=50))
        second = await client.generate(
            PROMPT, SamplingOptions(max_new_tokens=30, temperature=1.0, stop_token_ids=(IM_END_ID,))
        )
        assert stand_in.models_asked == 1 and client.model == "tiny-byte-lm"
        probe, body = stand_in.bodies[:2]  # the logprobs-mode probe (top_k 1), then the generation
        assert probe["prompt"] == [0] and probe["top_k"] == 1 and len(stand_in.bodies) == 3
        assert body["prompt"] == PROMPT and body["max_tokens"] == 16 and body["logprobs"] == 1
        assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
        assert body["top_k"] == 50 and "stop_token_ids" not in body
        assert stand_in.bodies[2]["stop_token_ids"] == [IM_END_ID]
        for generation in (first, second):
            assert len(generation.output_ids) == len(generation.logprobs) >= 1
            assert all(math.isfinite(lp) and lp <= 0 for lp in generation.logprobs)
            assert generation.weight_version is None and generation.server == url
            assert generation.finish_reason in ("stop", "length")
        assert len(first.output_ids) == 16 or first.finish_reason == "stop"
        # The logprobs are those of the sampling distribution (recomputed from the policy's model).
        sampled = GenerateParams(max_new_tokens=16, temperature=0.9, top_k=50)
        expected = stand_in_logprobs(stand_in.policy, PROMPT, first.output_ids, sampled, "processed_logprobs")
        assert first.logprobs == pytest.approx(expected, abs=1e-4)
    finally:
        await client.close()
        await stand_in.stop()


async def test_vllm_client_uses_the_given_model_and_maps_errors():
    stand_in = VLLMStandIn()
    url = await stand_in.start()
    wrong = VLLMClient(url, model="other-model", timeout_s=10)
    try:
        with pytest.raises(LLMServerError) as info:
            await wrong.generate(PROMPT, SHORT)
        assert info.value.status == 404 and not info.value.retryable
        assert stand_in.models_asked == 0
    finally:
        await wrong.close()
        await stand_in.stop()
    # The same client once the server is gone: a retryable connection error.
    gone = VLLMClient(url, model="tiny-byte-lm", timeout_s=5)
    with pytest.raises(LLMServerError) as info:
        await gone.generate(PROMPT, SHORT)
    await gone.close()
    assert info.value.retryable and info.value.status is None


async def test_vllm_client_refuses_raw_logprobs_for_a_reshaped_distribution():
    """A vLLM server started without --logprobs-mode processed_logprobs returns the logprobs of
    the model's raw distribution: at temperature 0.7 / top-k 50 they are not the behaviour
    policy's. The client finds the mode with one probe and refuses such a sampling (not
    retryable, so the pool does not try it elsewhere); plain sampling is the same either way."""
    reshaped = SamplingOptions(max_new_tokens=8, temperature=0.7, top_k=50)
    raw, processed = VLLMStandIn(logprobs_mode="raw_logprobs"), VLLMStandIn()
    raw_url, processed_url = await raw.start(), await processed.start()
    raw_client, processed_client = VLLMClient(raw_url, timeout_s=10), VLLMClient(processed_url, timeout_s=10)
    try:
        with pytest.raises(LLMServerError, match="--logprobs-mode processed_logprobs") as info:
            await raw_client.generate(PROMPT, reshaped)
        assert not info.value.retryable and await raw_client.logprobs_mode() == "raw_logprobs"
        plain = await raw_client.generate(PROMPT, SamplingOptions(max_new_tokens=8, temperature=1.0))
        assert len(plain.output_ids) == len(plain.logprobs) >= 1
        assert await processed_client.logprobs_mode() == "processed_logprobs"
        generation = await processed_client.generate(PROMPT, reshaped)
        params = GenerateParams(max_new_tokens=8, temperature=0.7, top_k=50)
        raw_view = stand_in_logprobs(processed.policy, PROMPT, generation.output_ids, params, "raw_logprobs")
        assert generation.logprobs != pytest.approx(raw_view, abs=1e-3)  # the two modes differ
        # One probe per server, whatever the number of generations.
        await processed_client.generate(PROMPT, reshaped)
        assert sum(body["prompt"] == [0] for body in processed.bodies) == 1
    finally:
        for client in (raw_client, processed_client):
            await client.close()
        await raw.stop()
        await processed.stop()


async def test_vllm_client_takes_weight_versions_from_the_token_endpoint_where_the_engine_has_it():
    """With scale-out, vLLM's /inference/v1/generate labels each token with the weights that
    sampled it: an integer label is the generation's weight version (else none, and the daemon's
    policy version stands in). Without it (403), the client falls back to /v1/completions, once."""
    scale_out, plain = VLLMStandIn(scale_out=True), VLLMStandIn()
    scale_out_url, plain_url = await scale_out.start(), await plain.start()
    labelled, unlabelled = VLLMClient(scale_out_url, timeout_s=10), VLLMClient(plain_url, timeout_s=10)
    sampling = SamplingOptions(max_new_tokens=6, temperature=0.8, stop_token_ids=(IM_END_ID,))
    try:
        assert (await labelled.generate(PROMPT, sampling)).weight_version is None  # "default"
        scale_out.weight_label = "12"
        generation = await labelled.generate(PROMPT, sampling)
        assert generation.weight_version == 12 and len(generation.output_ids) == len(generation.logprobs) >= 1
        body = scale_out.generate_bodies[-1]
        assert body["token_ids"] == PROMPT and body["sampling_params"]["logprobs"] == 0
        assert body["sampling_params"]["stop_token_ids"] == [IM_END_ID]
        assert labelled.token_endpoint is True and len(scale_out.bodies) == 1  # the logprobs probe only
        # Concurrent first generations all fall back, then the endpoint is not asked again.
        generations = await asyncio.gather(*(unlabelled.generate(PROMPT, sampling) for _ in range(3)))
        assert all(g.weight_version is None for g in generations)
        assert (await unlabelled.generate(PROMPT, sampling)).weight_version is None
        assert unlabelled.token_endpoint is False and len(plain.bodies) == 5  # probe and four generations
    finally:
        for client in (labelled, unlabelled):
            await client.close()
        await scale_out.stop()
        await plain.stop()


def test_vllm_parse_generate_reads_weight_version_spans():
    client = VLLMClient("http://127.0.0.1:1", model="m")
    choice = {
        "token_ids": [5, 6, 7],
        "finish_reason": "length",
        "logprobs": {"content": [{"token_id": 5, "logprob": -1.0}, {"token_id": 6, "logprob": -2.0}]},
        "weight_versions": [{"version": "4", "start": 0, "end": 1}, {"version": "5", "start": 1, "end": 3}],
    }
    with pytest.raises(LLMServerError, match="other ids"):
        client.parse_generate({"choices": [choice]})
    choice["logprobs"]["content"].append({"token_id": 7, "logprob": -0.5})
    generation = client.parse_generate({"choices": [choice]})
    assert generation.weight_version == 4  # the oldest, when the weights changed mid-generation
    assert generation.weight_versions == (4, 5, 5)  # and each token keeps its own label
    assert generation.output_ids == [5, 6, 7] and generation.logprobs == [-1.0, -2.0, -0.5]


def test_vllm_parse_appends_a_dropped_stop_token():
    client = VLLMClient("http://127.0.0.1:1", model="m")
    generation = client.parse(
        {
            "choices": [
                {
                    "token_ids": [5, 6],
                    "finish_reason": "stop",
                    "stop_reason": IM_END_ID,
                    "logprobs": {"token_logprobs": [-1.0, -2.0], "tokens": ["a", "b"]},
                }
            ]
        }
    )
    assert generation.output_ids == [5, 6, IM_END_ID] and generation.logprobs == [-1.0, -2.0, 0.0]
    with pytest.raises(LLMServerError, match="token_logprobs"):
        client.parse({"choices": [{"token_ids": [5], "finish_reason": "length", "logprobs": None}]})


# ---- the pool ---------------------------------------------------------------------------------------


class Servers:
    """Reference servers (tiny policy) for pool tests, stopped at the end."""

    def __init__(self) -> None:
        self.servers: list[ReferenceServer] = []

    async def start(self, latency_s: float = 0.0, port: int = 0) -> ReferenceServer:
        # grace_s: stop() drops requests in flight at once, as a crashing server would.
        server = ReferenceServer(TinyPolicy(seed=0), port=port, latency_s=latency_s, grace_s=0.001)
        await server.start()
        self.servers.append(server)
        return server

    async def stop_all(self) -> None:
        for server in self.servers:
            await server.stop()


@pytest.fixture
async def servers():
    group = Servers()
    yield group
    await group.stop_all()


@pytest.fixture
async def pool():
    pool = LLMPool(
        timeout_s=10, backoff_s=0.01, max_backoff_s=0.05, cooldown_s=0.5, unavailable_wait_s=0.3, health_interval_s=0.05
    )
    yield pool
    await pool.close()


def stats(pool: LLMPool) -> dict:
    return {s.address: s for s in pool.snapshot()}


async def test_pool_keeps_a_rollout_on_its_server_and_spreads_new_ones(servers, pool):
    a, b = await servers.start(), await servers.start()
    pool.register(a.url)
    pool.register(b.url + "/", protocol="sglang")  # normalised
    first = await pool.generate(PROMPT, SHORT, "r1")
    second = await pool.generate(PROMPT, SHORT, "r2")
    assert {first.server, second.server} == {a.url, b.url}  # new rollouts go to the less used server
    for _ in range(4):
        assert (await pool.generate(PROMPT, SHORT, "r1")).server == first.server
        assert (await pool.generate(PROMPT, SHORT, "r2")).server == second.server
    # After forget, r1 is a new rollout: it goes to the least used server (tied: fewest requests).
    pool.forget("r1")
    await pool.generate(PROMPT, SHORT, "r2")  # second's server now has one request more
    assert (await pool.generate(PROMPT, SHORT, "r1")).server == first.server
    snapshot = stats(pool)
    assert snapshot[a.url].requests + snapshot[b.url].requests == 12
    assert all(s.healthy and s.in_flight == 0 and s.failures == 0 for s in snapshot.values())


async def test_pool_sends_new_rollouts_to_the_least_loaded_server_by_weight(servers, pool):
    a, b = await servers.start(latency_s=0.4), await servers.start(latency_s=0.4)
    pool.register(a.url, weight=3)
    pool.register(b.url, weight=1)
    tasks = [asyncio.create_task(pool.generate(PROMPT, SHORT, f"r{i}")) for i in range(8)]
    await asyncio.sleep(0.15)
    in_flight = {s.address: s.in_flight for s in pool.snapshot()}
    assert in_flight == {a.url: 6, b.url: 2}
    generations = await asyncio.gather(*tasks)
    assert sum(g.server == a.url for g in generations) == 6


async def test_pool_spills_an_overloaded_sticky_server(servers, pool):
    a = await servers.start(latency_s=0.6)
    pool.register(a.url)
    assert (await pool.generate(PROMPT, SHORT, "sticky")).server == a.url
    busy = [asyncio.create_task(pool.generate(PROMPT, SHORT, f"busy{i}")) for i in range(4)]
    await asyncio.sleep(0.1)
    b = await servers.start()
    pool.register(b.url)
    # a has 4 in flight, b none: 4 > 2 * 0 + 1, so the sticky rollout moves to b (and stays there).
    assert (await pool.generate(PROMPT, SHORT, "sticky")).server == b.url
    assert (await pool.generate(PROMPT, SHORT, "sticky")).server == b.url
    await asyncio.gather(*busy)
    # One request in flight on the sticky server is no overload (1 <= 2 * 0 + 1): it stays.
    pool._stick("holder", a.url)
    pool._stick("stays", a.url)
    hold = asyncio.create_task(pool.generate(PROMPT, SHORT, "holder"))
    await asyncio.sleep(0.1)
    assert stats(pool)[a.url].in_flight == 1 and stats(pool)[b.url].in_flight == 0
    assert (await pool.generate(PROMPT, SHORT, "stays")).server == a.url
    assert (await hold).server == a.url


async def test_pool_fails_over_when_a_server_dies_and_takes_it_back_after_the_cool_down(servers):
    now = [1000.0]  # the pool's clock, moved by hand past the cool-down
    pool = LLMPool(timeout_s=10, backoff_s=0.01, cooldown_s=30, clock=lambda: now[0])
    try:
        a, b = await servers.start(latency_s=0.3), await servers.start(latency_s=0.05)
        pool.register(a.url)
        pool.register(b.url)
        assert (await pool.generate(PROMPT, SHORT, "r")).server == a.url  # a registered first: tie goes to it
        in_flight = asyncio.create_task(pool.generate(PROMPT, SHORT, "r"))
        await asyncio.sleep(0.1)
        assert stats(pool)[a.url].in_flight == 1
        await a.stop()  # dies with the request in flight
        generation = await in_flight
        assert generation.server == b.url  # retried on the other server
        snapshot = stats(pool)
        assert not snapshot[a.url].healthy and snapshot[a.url].failures == 1
        assert snapshot[b.url].healthy
        # While a cools down, everything goes to b, even new rollouts and even once a is back up.
        a_again = await servers.start(latency_s=0.2, port=a.port)
        assert a_again.url == a.url
        for i in range(3):
            assert (await pool.generate(PROMPT, SHORT, f"new{i}")).server == b.url
        now[0] += 29
        assert (await pool.generate(PROMPT, SHORT, "new3")).server == b.url
        assert a_again.requests_served == 0
        now[0] += 2
        # After the cool-down a gets one probe request at a time (it has the fewest requests);
        # the others go to b. Once the probe succeeds a is healthy again and takes its share.
        generations = await asyncio.gather(*(pool.generate(PROMPT, SHORT, f"later{i}") for i in range(3)))
        assert [g.server for g in generations] == [a.url, b.url, b.url]
        assert stats(pool)[a.url].healthy and a_again.requests_served == 1
        generations = await asyncio.gather(*(pool.generate(PROMPT, SHORT, f"after{i}") for i in range(2)))
        assert a.url in {g.server for g in generations}
    finally:
        await pool.close()


async def test_pool_retries_5xx_on_another_server(servers, pool):
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "CUDA out of memory"}}, status=503)

    app = web.Application()
    app.router.add_post("/generate", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    broken_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        good = await servers.start()
        pool.register(broken_url)
        pool.register(good.url)
        generation = await pool.generate(PROMPT, SHORT, "r")
        assert generation.server == good.url
        snapshot = stats(pool)
        assert not snapshot[broken_url].healthy and snapshot[broken_url].failures == 1
        assert snapshot[good.url].requests == 1
    finally:
        await runner.cleanup()


async def test_pool_raises_llm_unavailable_when_everything_is_down(servers, pool):
    with pytest.raises(LLMUnavailable, match="no LLM server is registered"):
        await pool.generate(PROMPT, SHORT, "r")
    a, b = await servers.start(), await servers.start()
    pool.register(a.url)
    pool.register(b.url)
    await a.stop()
    await b.stop()
    started = time.monotonic()
    with pytest.raises(LLMUnavailable) as info:
        await pool.generate(PROMPT, SHORT, "r")
    assert not isinstance(info.value, LLMRequestRejected)
    assert time.monotonic() - started < 2
    snapshot = stats(pool)
    assert all(not s.healthy and s.failures >= 1 and s.in_flight == 0 for s in snapshot.values())
    assert sum(s.requests for s in snapshot.values()) == pool.max_attempts


async def test_pool_makes_all_its_attempts_on_a_single_dead_server(servers, pool):
    """N attempts mean N requests, also when the only server is down: the retries do
    not fall through while it cools down (they wait out unavailable_wait_s, then go anyway)."""
    a = await servers.start()
    pool.register(a.url)
    await a.stop()
    started = time.monotonic()
    with pytest.raises(LLMUnavailable, match=f"after {pool.max_attempts} attempts"):
        await pool.generate(PROMPT, SHORT, "r")
    assert time.monotonic() - started >= pool.unavailable_wait_s
    assert stats(pool)[a.url].requests == pool.max_attempts


@pytest.mark.parametrize("cooldown_s", [0.3, 60], ids=["short_cooldown", "long_cooldown"])
async def test_pool_waits_out_a_restart_of_its_only_server(servers, cooldown_s):
    """A restart of the only server does not filter the rollouts waiting on it: the pool polls
    the server's health endpoint (within unavailable_wait_s) and goes on once it is back: long
    before its cool-down ends when that is long, and without spending attempts on requests to a
    server whose health endpoint does not answer when it is short."""
    pool = LLMPool(timeout_s=10, backoff_s=0.01, max_backoff_s=0.05, cooldown_s=cooldown_s, unavailable_wait_s=20)
    try:
        a = await servers.start()
        pool.register(a.url)
        assert (await pool.generate(PROMPT, SHORT, "r0")).server == a.url
        await a.stop()
        started = time.monotonic()
        waiting = [asyncio.create_task(pool.generate(PROMPT, SHORT, f"r{i}")) for i in range(4)]
        await asyncio.sleep(2.5)
        assert not any(task.done() for task in waiting)
        a_again = await servers.start(port=a.port)
        generations = await asyncio.gather(*waiting)
        assert all(g.server == a.url for g in generations)
        assert 2.5 <= time.monotonic() - started < 10
        assert a_again.requests_served == 4 and stats(pool)[a.url].healthy
        # Each waiting call failed once at most; the rest of the wait was health probes.
        assert stats(pool)[a.url].requests <= 1 + 4 + 4
    finally:
        await pool.close()


async def test_pool_does_not_retry_a_rejected_request(pool):
    replay = [ReferenceServer(ReplayPolicy([replay_task()])) for _ in range(2)]
    for server in replay:
        await server.start()
        pool.register(server.url)
    try:
        with pytest.raises(LLMRequestRejected) as info:
            await pool.generate(PROMPT, SHORT, "r")  # no replay task has this prompt: 400
        assert info.value.status == 400 and isinstance(info.value, LLMUnavailable)
        snapshot = pool.snapshot()
        assert sum(s.requests for s in snapshot) == 1 and all(s.healthy for s in snapshot)
    finally:
        for server in replay:
            await server.stop()


async def test_pool_registers_and_removes_servers_at_run_time(servers, pool):
    a, b = await servers.start(latency_s=0.3), await servers.start()
    pool.register(a.url, weight=2, model="m")
    with pytest.raises(ServerAlreadyRegistered):
        pool.register(a.url + "/")
    with pytest.raises(InvalidArgument):
        pool.register(b.url, protocol="tgi")
    with pytest.raises(InvalidArgument):
        pool.register("ftp://host:1")
    pending = asyncio.create_task(pool.generate(PROMPT, SHORT, "r"))
    await asyncio.sleep(0.1)
    pool.register(b.url, protocol="SGLANG")
    pool.remove(a.url)  # the request in flight on a still finishes there
    assert (await pending).server == a.url
    assert [s.address for s in pool.snapshot()] == [b.url]
    assert (await pool.generate(PROMPT, SHORT, "r")).server == b.url  # sticky to a, but a is gone
    with pytest.raises(UnknownServer):
        pool.remove(a.url)
    assert a.url not in pool and b.url in pool and len(pool) == 1
    info = pool.snapshot()[0]
    assert (info.protocol, info.weight, info.model, info.requests) == ("sglang", 1, "", 1)


async def test_pool_speaks_vllm_too(pool):
    stand_in = VLLMStandIn()
    url = await stand_in.start()
    try:
        pool.register(url, protocol="vllm", model="tiny-byte-lm")
        generation = await pool.generate(PROMPT, SHORT, "r")
        assert generation.server == url and len(generation.output_ids) == len(generation.logprobs) > 0
        assert stand_in.models_asked == 0  # the registered model name is used
    finally:
        await stand_in.stop()


async def test_pool_reports_the_smallest_context_window_its_servers_report(servers, pool):
    assert await pool.context_length() is None  # no server
    reference = await servers.start()  # no /v1/models: reports none
    wide, narrow = VLLMStandIn(max_model_len=4096), VLLMStandIn(max_model_len=700)
    urls = [await wide.start(), await narrow.start()]
    try:
        pool.register(reference.url)
        assert await pool.context_length() is None
        for url in urls:
            pool.register(url, protocol="vllm")
        assert await pool.context_length() == 700
        assert await pool.context_length() == 700 and narrow.models_asked == 1  # asked once
    finally:
        await wide.stop()
        await narrow.stop()


async def test_a_server_that_does_not_answer_costs_the_context_window_one_wait_per_cooldown():
    """A server that accepts connections and never answers is asked at once with the others, for
    at most context_timeout_s, and not again before its cool-down: not a wait on every turn."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    silent_url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    narrow = VLLMStandIn(max_model_len=700)
    pool = LLMPool(cooldown_s=30, context_timeout_s=0.3)
    try:
        pool.register(silent_url, protocol="vllm", model="m")
        pool.register(await narrow.start(), protocol="vllm")
        started = time.monotonic()
        assert await pool.context_length() == 700
        assert time.monotonic() - started < 1.5 and len(accepted) == 1
        started = time.monotonic()
        for _ in range(5):
            assert await pool.context_length() == 700
        assert time.monotonic() - started < 0.25 and len(accepted) == 1  # not asked again yet
    finally:
        await pool.close()
        await narrow.stop()
        for writer in accepted:
            writer.close()
        listener.close()
        await listener.wait_closed()


class NoTools:
    """A toolbox for loops whose replies never hold a tool call (the tiny policy's noise)."""

    tools = frozenset({"bash", "submit"})

    async def call(self, call, timeout_s):
        raise AssertionError(f"no tool call expected, got {call}")


async def test_a_rollout_ends_as_context_full_before_vllm_refuses_its_prompt(pool):
    """The server's max_model_len (much smaller than the task's max_total_tokens) bounds the
    rollout: each request fits it, and the loop ends as CONTEXT_FULL (the rollout is evaluated)
    instead of meeting vLLM's 400 (which the pool raises as LLMRequestRejected: filtered)."""
    stand_in = VLLMStandIn(max_model_len=1600)  # the prompt (tool instructions) is about 1100 bytes
    url = await stand_in.start()
    try:
        pool.register(url, protocol="vllm")
        loop = AgentLoop(
            TOK,
            pool.generate,
            NoTools(),
            limits=AgentLimits(
                max_turns=50,
                max_new_tokens_per_turn=160,
                max_total_tokens=100_000,
                action_timeout_s=5,
                max_consecutive_format_errors=50,
            ),
            tool_call_format=ToolCallFormat.HERMES,
            sampling=SamplingOptions(max_new_tokens=1),
            rollout_id="r",
            policy_version=lambda: 0,
            context_length=pool.context_length,
        )
        trajectory = await loop.run([{"role": "user", "content": "Fix the bug."}])
        assert trajectory.finish_reason is FinishReason.CONTEXT_FULL
        assert len(trajectory.turns) >= 2
        assert len(trajectory.prompt_ids) + len(trajectory.response_ids) <= 1600
        for body in stand_in.bodies:
            assert len(body["prompt"]) + body["max_tokens"] <= 1600
    finally:
        await stand_in.stop()


async def test_pool_sends_each_rollouts_id_as_the_routing_key(servers, pool) -> None:
    """A router in front of several engines (SGLang's gateway) keeps a rollout on one engine by
    this header; the reference server answers, a stand-in in front of it records the header."""
    reference = await servers.start()
    seen: list[str | None] = []

    async def router(request: web.Request) -> web.Response:
        seen.append(request.headers.get(ROUTING_KEY_HEADER))
        async with ClientSession() as session:
            async with session.post(f"{reference.url}/generate", json=await request.json()) as answer:
                return web.json_response(await answer.json(), status=answer.status)

    app = web.Application()
    app.router.add_post("/generate", router)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        pool.register(f"http://127.0.0.1:{runner.addresses[0][1]}")
        await pool.generate(PROMPT, SHORT, "rollout-a")
        await pool.generate(PROMPT, SHORT, "rollout-b")
        await pool.generate(PROMPT, SHORT, "rollout-a")
        assert seen == ["rollout-a", "rollout-b", "rollout-a"]
    finally:
        await runner.cleanup()
