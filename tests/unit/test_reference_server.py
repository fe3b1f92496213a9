"""The built-in reference LLM server over real HTTP: the replay policy plays reference solutions
back turn by turn, the tiny policy really samples (reproducibly, with true logprobs), weights
update from disk, and the command line serves."""

from __future__ import annotations

import pytest

from tests.torch_needed import TORCH_MISSING

pytest.importorskip("torch", reason=TORCH_MISSING)

import json
import math
import subprocess
import sys
import urllib.request

import aiohttp
import torch
from torch.nn import functional as F

from corral.rollout.llm.client import LLMServerError
from corral.rollout.llm.sglang import SGLangClient
from corral.rollout.prompt import MissingPromptField, fill_prompt_fields
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.rollout.reference.tiny import TinyPolicy
from corral.rollout.reference.tiny_model import TinyByteLM
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, parse_tool_calls
from corral.rollout.types import SamplingOptions, ToolCall
from corral.v1 import rollout_pb2 as pb

TOK = ByteChatTokenizer()
IM_END_ID = TOK.special_ids["<|im_end|>"]


def make_task(
    task_id: str,
    user: str,
    fields: dict[str, str],
    calls: list[tuple[str, dict]],
    fmt: pb.ToolCallFormat = pb.TOOL_CALL_FORMAT_HERMES,
    system: str = "You are an agent.",
) -> pb.Task:
    task = pb.Task(task_id=task_id, tool_call_format=fmt)
    task.prompt.messages.add(role="system", content=system)
    task.prompt.messages.add(role="user", content=user)
    task.prompt.fields.update(fields)
    for name, arguments in calls:
        task.reference_solution.add(name=name, arguments_json=json.dumps(arguments))
    return task


def normalized(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls with bash commands' trailing newline dropped (a fenced block always ends its command
    with one)."""
    return [
        ToolCall(c.name, {**c.arguments, "command": c.arguments["command"].rstrip("\n")}) if c.name == "bash" else c
        for c in calls
    ]


def prompt_messages(task: pb.Task) -> list[dict[str, str]]:
    return [
        {"role": m.role, "content": fill_prompt_fields(m.content, task.prompt.fields)} for m in task.prompt.messages
    ]


HERMES_TASK = make_task(
    "fix-bug",
    "Fix the bug in {file}. Braces stay: {{x}}.",
    {"file": "calc.py"},
    [
        ("bash", {"command": "cat calc.py"}),
        ("editor", {"command": "str_replace", "path": "calc.py", "old": "-", "new": "+"}),
    ],
)
BASH_TASK = make_task(
    "count-lines",
    "Count the lines of {file}.",
    {"file": "data.txt"},
    [("bash", {"command": "wc -l data.txt"})],
    fmt=pb.TOOL_CALL_FORMAT_FENCED_BASH,
)


def test_fill_prompt_fields():
    assert fill_prompt_fields('a {x} {{y}} {{{x}}} {"k": 1}', {"x": "{z}"}) == 'a {z} {y} {{z}} {"k": 1}'
    with pytest.raises(MissingPromptField) as info:
        fill_prompt_fields("hi {name}", {})
    assert info.value.name == "name" and "{name}" in str(info.value)


async def test_replay_plays_the_reference_solution_in_order_then_submits():
    server = ReferenceServer(ReplayPolicy([BASH_TASK, HERMES_TASK]))
    url = await server.start()
    client = SGLangClient(url, timeout_s=10)
    try:
        for task, fmt in ((HERMES_TASK, ToolCallFormat.HERMES), (BASH_TASK, ToolCallFormat.FENCED_BASH)):
            # The agent loop may put its own system prompt first; the task is still recognised.
            history = [{"role": "system", "content": "Tools: bash, editor, submit."}] + prompt_messages(task)
            ids = TOK.encode_prompt(history)
            expected = [ToolCall(c.name, json.loads(c.arguments_json)) for c in task.reference_solution]
            expected.append(ToolCall("submit", {}))
            for turn, want in enumerate(expected):
                generation = await client.generate(ids, SamplingOptions(max_new_tokens=512))
                assert generation.finish_reason == "stop"
                assert generation.output_ids[-1] == IM_END_ID  # the stop token is in the output
                assert generation.logprobs == [0.0] * len(generation.output_ids)
                assert generation.weight_version == 0 and generation.server == url
                text = TOK.decode(generation.output_ids[:-1])
                assert normalized(parse_tool_calls(text, fmt)) == [want], (task.task_id, turn, text)
                # The next prompt: this turn, a tool observation, the next generation prompt.
                ids = (
                    ids
                    + generation.output_ids
                    + TOK.encode_continuation(
                        history, generation.output_ids, [{"role": "tool", "content": f"output {turn}"}]
                    )
                )
            # Past the end it keeps submitting.
            again = await client.generate(ids, SamplingOptions(max_new_tokens=512))
            assert parse_tool_calls(TOK.decode(again.output_ids[:-1]), fmt) == [ToolCall("submit", {})]

        # max_new_tokens smaller than the answer: cut, finish "length", no stop token.
        short = await client.generate(
            TOK.encode_prompt(prompt_messages(HERMES_TASK)), SamplingOptions(max_new_tokens=5)
        )
        assert short.finish_reason == "length" and len(short.output_ids) == 5 and IM_END_ID not in short.output_ids
    finally:
        await client.close()
        await server.stop()


async def test_replay_answers_400_for_an_unknown_prompt():
    server = ReferenceServer(ReplayPolicy([HERMES_TASK]))
    url = await server.start()
    try:
        prompt = TOK.encode_prompt([{"role": "user", "content": "Something no task asks."}])
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/generate", json={"input_ids": prompt, "sampling_params": {}}) as response:
                assert response.status == 400
                body = await response.json()
        assert "knows no task" in body["error"]["message"]
        client = SGLangClient(url, timeout_s=10)
        with pytest.raises(LLMServerError) as info:
            await client.generate(prompt, SamplingOptions(max_new_tokens=8))
        await client.close()
        assert info.value.status == 400 and not info.value.retryable
    finally:
        await server.stop()


def recomputed_logprobs(model: TinyByteLM, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each sampled token, from one forward pass over the whole text."""
    with torch.no_grad():
        logits, _ = model(torch.tensor([prompt + output]))
    scaled = logits[0, len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    return F.log_softmax(scaled, dim=-1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1).tolist()


async def generate_raw(session: aiohttp.ClientSession, url: str, ids: list[int], **params) -> dict:
    async with session.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": params, "return_logprob": True}
    ) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_tiny_policy_samples_reproducibly_with_true_logprobs():
    policy = TinyPolicy(seed=3)
    server = ReferenceServer(policy)
    url = await server.start()
    prompt = TOK.encode_prompt([{"role": "user", "content": "Say something."}])
    try:
        async with aiohttp.ClientSession() as session:
            first = await generate_raw(session, url, prompt, max_new_tokens=40, temperature=0.8, sampling_seed=11)
            second = await generate_raw(session, url, prompt, max_new_tokens=40, temperature=0.8, sampling_seed=11)
            other = await generate_raw(session, url, prompt, max_new_tokens=40, temperature=0.8, sampling_seed=12)
            greedy = await generate_raw(session, url, prompt, max_new_tokens=20, temperature=0.0)
            top1 = await generate_raw(
                session, url, prompt, max_new_tokens=20, temperature=1.3, top_k=1, sampling_seed=5
            )
        assert first["output_ids"] == second["output_ids"]
        assert first["output_ids"] != other["output_ids"]
        assert 0 < len(first["output_ids"]) <= 40
        meta = first["meta_info"]
        assert meta["weight_version"] == "0" and meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == len(first["output_ids"])
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == first["output_ids"]
        logprobs = [t[0] for t in triples]
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
        assert logprobs == pytest.approx(recomputed_logprobs(policy.model, prompt, first["output_ids"], 0.8), abs=1e-4)
        # Greedy is the argmax at every step, and top_k=1 samples the same tokens.
        assert greedy["output_ids"] == top1["output_ids"][: len(greedy["output_ids"])]
        with torch.no_grad():
            logits, _ = policy.model(torch.tensor([prompt + greedy["output_ids"]]))
        argmax = logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert greedy["output_ids"] == argmax[: len(greedy["output_ids"])]
        if meta["finish_reason"]["type"] == "length":
            assert meta["finish_reason"]["length"] == 40
    finally:
        await server.stop()


async def test_tiny_policy_stops_on_stop_token_ids_and_stop_strings():
    policy = TinyPolicy(seed=0)
    server = ReferenceServer(policy)
    url = await server.start()
    prompt = TOK.encode_prompt([{"role": "user", "content": "Go."}])
    try:
        async with aiohttp.ClientSession() as session:
            free = await generate_raw(
                session, url, prompt, max_new_tokens=60, temperature=1.0, sampling_seed=4, ignore_eos=True
            )
            ids = free["output_ids"]
            assert len(ids) == 60 and free["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
            # Asking to stop on the 10th sampled token (first occurrence) stops right there, keeping it.
            stop_id = ids[9]
            cut = ids.index(stop_id) + 1
            stopped = await generate_raw(
                session,
                url,
                prompt,
                max_new_tokens=60,
                temperature=1.0,
                sampling_seed=4,
                ignore_eos=True,
                stop_token_ids=[stop_id],
            )
            assert stopped["output_ids"] == ids[:cut]
            assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    finally:
        await server.stop()


async def test_update_weights_from_disk_bumps_the_version_and_changes_outputs(tmp_path):
    policy = TinyPolicy(seed=0)
    server = ReferenceServer(policy)
    url = await server.start()
    prompt = TOK.encode_prompt([{"role": "user", "content": "Hello."}])
    torch.manual_seed(123)
    trained = TinyByteLM()
    torch.save(trained.state_dict(), tmp_path / "step1.pt")
    torch.save({"config": trained.config, "state_dict": trained.state_dict()}, tmp_path / "step2.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    client = SGLangClient(url, timeout_s=10)
    try:
        async with aiohttp.ClientSession() as session:
            before = await generate_raw(session, url, prompt, max_new_tokens=30, sampling_seed=1)
            async with session.post(
                url + "/update_weights_from_disk", json={"model_path": str(tmp_path / "step1.pt")}
            ) as r:
                assert r.status == 200
                assert (await r.json())["success"] is True
            assert await client.get_weight_version() == 1
            after = await generate_raw(session, url, prompt, max_new_tokens=30, sampling_seed=1)
            assert after["meta_info"]["weight_version"] == "1"
            assert after["output_ids"] != before["output_ids"]
            assert [t[0] for t in after["meta_info"]["output_token_logprobs"]] == pytest.approx(
                recomputed_logprobs(trained, prompt, after["output_ids"], 1.0), abs=1e-4
            )
            # An explicit version is taken as given.
            async with session.post(
                url + "/update_weights_from_disk",
                json={"model_path": str(tmp_path / "step2.pt"), "weight_version": "7"},
            ) as r:
                assert r.status == 200
            async with session.get(url + "/get_model_info") as r:
                info = await r.json()
            assert info["weight_version"] == "7" and info["model_path"] == "builtin:tiny"
            generation = await client.generate(prompt, SamplingOptions(max_new_tokens=5))
            assert generation.weight_version == 7
            # Unusable files fail with 400 and leave the version alone.
            for payload in (
                {"model_path": str(tmp_path / "junk.pt")},
                {"model_path": str(tmp_path / "missing.pt")},
                {"model_path": str(tmp_path / "step1.pt"), "weight_version": "v2"},
            ):
                async with session.post(url + "/update_weights_from_disk", json=payload) as r:
                    assert r.status == 400
                    assert (await r.json())["success"] is False
            assert await client.get_weight_version() == 7
    finally:
        await client.close()
        await server.stop()


async def test_replay_has_no_weights_to_update(tmp_path):
    server = ReferenceServer(ReplayPolicy([HERMES_TASK]))
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}) as r:
                assert r.status == 400
                assert "no weights" in (await r.json())["message"]
    finally:
        await server.stop()


def test_start_in_thread_serves_sync_callers():
    server = ReferenceServer(ReplayPolicy([HERMES_TASK]))
    url = server.start_in_thread()
    try:
        body = json.dumps(
            {"input_ids": TOK.encode_prompt(prompt_messages(HERMES_TASK)), "sampling_params": {"max_new_tokens": 256}}
        ).encode()
        request = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": IM_END_ID}
        # The text drops special tokens and the matched stop; output_ids keep them.
        assert answer["text"].startswith("<tool_call>") and "<|im_end|>" not in answer["text"]
        assert answer["output_ids"][-1] == IM_END_ID
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            assert response.status == 200
    finally:
        server.stop_in_thread()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=2)


def test_command_line_serves_replay_tasks(tmp_path):
    from google.protobuf import json_format

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json_format.MessageToJson(t, indent=None) for t in (HERMES_TASK, BASH_TASK)) + "\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "corral.rollout.reference.server",
            "--policy",
            "replay",
            "--tasks",
            str(tasks),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else url
        body = json.dumps(
            {
                "input_ids": TOK.encode_prompt(prompt_messages(BASH_TASK)),
                "sampling_params": {"max_new_tokens": 256},
                "return_logprob": True,
            }
        ).encode()
        request = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
        calls = parse_tool_calls(answer["text"], ToolCallFormat.FENCED_BASH)
        assert normalized(calls) == [ToolCall("bash", {"command": "wc -l data.txt"})]
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0
        proc.stdout.close()
        proc.stderr.close()
