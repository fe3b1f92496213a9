"""The veRL adapter against the real veRL package: agent loops instantiated as veRL's
AgentLoopWorker instantiates them, rows read by veRL's RLHFDataset, outputs padded and batched by
veRL's own postprocessing; a real daemon runs the sandboxes, and the built-in reference server
(replay policy) stands in for veRL's inference servers."""

from __future__ import annotations

from tests.conftest import require_trainer

require_trainer("verl", "verl", "verl")

import asyncio  # noqa: E402
import dataclasses  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopOutput,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.utils.dataset.rl_dataset import RLHFDataset  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402

from corral.cli.run import is_token_exact  # noqa: E402
from corral.rollout.llm.sglang import SGLangClient  # noqa: E402
from corral.rollout.tokenizer import ByteChatTokenizer, HFChatTokenizer  # noqa: E402
from corral.rollout.types import LLMUnavailable, SamplingOptions  # noqa: E402
from corral.sdk import AsyncClient, RolloutResult, load_tasks  # noqa: E402
from corral.sdk.tasks import task_to_json  # noqa: E402
from corral.trainer_adapters import verl as adapter  # noqa: E402
from tests.rollout_tasks import repair_task, replay_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "verl"
BUNDLED = ROOT / "examples" / "tasks" / "repair.jsonl"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_hf_tokenizer():
    """A real Hugging Face tokenizer (what veRL hands its agent loops) whose ids are those of the
    replay policy's ByteChatTokenizer: ids 0-255 are bytes, 256-258 the ChatML special tokens,
    with the ChatML chat template. Built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):  # GPT-2's byte-to-unicode table, which the ByteLevel pre-tokenizer uses
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte], extra = chr(256 + extra), extra + 1
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(ByteChatTokenizer.SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


@pytest.fixture(scope="module")
def verl_tokenizer():
    tokenizer = byte_level_hf_tokenizer()
    byte = ByteChatTokenizer()
    chat = [{"role": "system", "content": "sé"}, {"role": "user", "content": "fix <|im_end|> it"}]
    assert HFChatTokenizer(tokenizer).encode_prompt(chat) == byte.encode_prompt(chat)  # the premise
    return tokenizer


def trainer_config(prompt_length: int = 4096, response_length: int = 8192, name: str = "sglang"):
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"name": name, "prompt_length": prompt_length, "response_length": response_length}
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )


def make_loop(agent_name: str, server_manager: Any, tokenizer: Any, config=None, **overrides: Any):
    """An agent loop exactly as AgentLoopWorker._run_agent_loop makes one."""
    config = config if config is not None else trainer_config()
    return hydra.utils.instantiate(
        config=_agent_loop_registry[agent_name],
        trainer_config=DictConfigWrap(config=config),
        server_manager=server_manager,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap([]),
        **overrides,
    )


class ReferenceServerManager:
    """Stands in for veRL's LLMServerClient (the agent loops' `server_manager`): no GPU inference
    server runs here, so `generate` asks corral's built-in reference server through corral's
    SGLangClient and answers with veRL's own TokenOutput, shaped as veRL's servers shape it:
    `style` "sglang" passes the finish reason through, "vllm" says "completed"; log_probs only
    when sampling_params["logprobs"]; global_steps (and min/max, as LLMServerClient adds them)
    when given."""

    def __init__(
        self, url: str, *, style: str = "sglang", global_steps: int | None = None, fail: Exception | None = None
    ) -> None:
        self.client = SGLangClient(url)
        self.style = style
        self.global_steps = global_steps
        self.fail = fail
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        self.calls.append((request_id, dict(sampling_params)))
        if self.fail is not None:
            raise self.fail
        params = dict(sampling_params)
        sampling = SamplingOptions(
            max_new_tokens=params.pop("max_tokens"),
            temperature=params["temperature"],
            top_p=params["top_p"],
            top_k=params["top_k"],
            stop=tuple(params.get("stop", ())),
            stop_token_ids=tuple(params.get("stop_token_ids", ())),
        )
        generation = await self.client.generate(prompt_ids, sampling)
        reason = generation.finish_reason
        if self.style == "vllm":
            reason = "aborted" if reason == "abort" else "completed"
        extra = (
            {}
            if self.global_steps is None
            else {
                "global_steps": self.global_steps,
                "min_global_steps": self.global_steps,
                "max_global_steps": self.global_steps,
            }
        )
        return TokenOutput(
            token_ids=generation.output_ids,
            log_probs=generation.logprobs if params.get("logprobs") else None,
            stop_reason=reason,
            extra_fields=extra,
        )

    async def close(self) -> None:
        await self.client.close()


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


class Recorded:
    """Records the RolloutResults the tools-mode loop gets (to compare with its output)."""

    def __init__(self, monkeypatch) -> None:
        self.results: dict[str, RolloutResult] = {}
        recorded = self

        class Recording(adapter.ToolsModeRollouts):
            async def run(self, task, **kwargs):
                result = await super().run(task, **kwargs)
                recorded.results[result.rollout_id] = result
                return result

        monkeypatch.setattr(adapter, "ToolsModeRollouts", Recording)


async def task_sandboxes(address: str, *task_ids: str) -> list[str]:
    async with AsyncClient(address) as client:
        return [s.id for s in await client.list_sandboxes() if s.labels.get("io.corral.task") in task_ids]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"verl_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dataset_rows(tmp_path: Path, tokenizer, count: int) -> list[dict[str, Any]]:
    """The first `count` bundled tasks, written by examples/verl/make_dataset.py and read back by
    veRL's RLHFDataset, as the kwargs AgentLoopWorker passes to run() (it consumes agent_name)."""
    make_dataset = load_example("make_dataset")
    out = tmp_path / "train.parquet"
    make_dataset.write(make_dataset.rows(str(BUNDLED))[:count], str(out))
    dataset = RLHFDataset(
        [str(out)],
        tokenizer,
        OmegaConf.create(
            {"cache_dir": str(tmp_path / "cache"), "max_prompt_length": 4096, "filter_overlong_prompts": False}
        ),
    )
    rows = []
    for i in range(len(dataset)):
        row = dict(dataset[i])
        assert row.pop("agent_name") == "corral"
        row.pop("dummy_tensor")
        rows.append(row)
    return rows


# --- registration, configuration --------------------------------------------------------------------


def test_the_loops_are_registered_and_the_yaml_example_is_what_verl_loads(verl_tokenizer, monkeypatch) -> None:
    assert _agent_loop_registry["corral"] == {"_target_": "corral.trainer_adapters.verl.CorralAgentLoop"}
    assert _agent_loop_registry["corral_service"] == {"_target_": "corral.trainer_adapters.verl.CorralServiceAgentLoop"}
    # What AgentLoopWorker.__init__ does with rollout.agent.agent_loop_config_path.
    entries: Any = OmegaConf.load(EXAMPLES / "agent_loop.yaml")  # a ListConfig of DictConfigs
    assert [entry.name for entry in entries] == ["corral", "corral_service"]
    for entry in entries:
        monkeypatch.setitem(_agent_loop_registry, entry.name, entry)
    loop = make_loop("corral", object(), verl_tokenizer)
    assert isinstance(loop, adapter.CorralAgentLoop)
    assert (loop.corral_address, loop.filtered_reward, loop.prompt_length, loop.response_length) == (
        None,
        None,
        4096,
        8192,
    )
    assert isinstance(loop.chat_tokenizer, HFChatTokenizer)  # veRL's own tokenizer by default
    override = make_loop(
        "corral",
        object(),
        verl_tokenizer,
        corral_tokenizer="byte",
        filtered_reward=0.0,
        corral_address="unix:///x.sock",
    )
    assert isinstance(override.chat_tokenizer, ByteChatTokenizer)
    assert (override.filtered_reward, override.corral_address) == (0.0, "unix:///x.sock")
    service = make_loop("corral_service", object(), verl_tokenizer, config=trainer_config(name="vllm"))
    assert isinstance(service, adapter.CorralServiceAgentLoop) and service.corral_protocol == "vllm"


def test_without_verl_the_import_error_names_the_extra(monkeypatch) -> None:
    monkeypatch.delitem(sys.modules, "corral.trainer_adapters.verl")
    monkeypatch.setitem(sys.modules, "verl.experimental.agent_loop.agent_loop", None)
    with pytest.raises(ImportError, match=r"pip install 'corral\[verl\]'"):
        importlib.import_module("corral.trainer_adapters.verl")


def test_the_task_comes_from_the_row_in_every_form_veRL_gives_it() -> None:
    task = repair_task("row")
    as_dict = json.loads(task_to_json(task))
    assert adapter.task_from_row({"extra_info": {"corral_task": task_to_json(task)}}) == task
    assert adapter.task_from_row({"extra_info": {}, "corral_task": as_dict}) == task
    # Parquet structs: lists as numpy arrays, keys of other rows as None.
    parquet_like = {**as_dict, "image": None, "reference_solution": np.array(as_dict["reference_solution"])}
    assert adapter.task_from_row({"extra_info": {"corral_task": parquet_like}}) == task
    bare = {"task_id": "bare", "evaluation": {"commands": ["true"], "exit_status": {}}}
    raw_prompt = np.array([{"role": "user", "content": "hello"}], dtype=object)
    from_prompt = adapter.task_from_row({"extra_info": {"corral_task": bare}, "raw_prompt": raw_prompt})
    assert [(m.role, m.content) for m in from_prompt.prompt.messages] == [("user", "hello")]
    with pytest.raises(ValueError, match="extra_info.corral_task"):
        adapter.task_from_row({"extra_info": {"index": 0}, "raw_prompt": raw_prompt})


def test_token_outputs_become_generations_whatever_the_backend_says() -> None:
    sampling = SamplingOptions(max_new_tokens=3, stop_token_ids=(257,))
    convert = adapter.token_output_to_generation
    # vLLM: "completed" is stop or length.
    assert convert(TokenOutput(token_ids=[1, 257], stop_reason="completed"), sampling).finish_reason == "stop"
    assert convert(TokenOutput(token_ids=[1, 2, 3], stop_reason="completed"), sampling).finish_reason == "length"
    assert convert(TokenOutput(token_ids=[1], stop_reason=None), sampling).finish_reason == "stop"
    # SGLang passes its own through.
    assert convert(TokenOutput(token_ids=[1, 2, 3], stop_reason="stop"), sampling).finish_reason == "stop"
    assert convert(TokenOutput(token_ids=[1], stop_reason="aborted"), sampling).finish_reason == "abort"
    with pytest.raises(LLMUnavailable, match="aborted"):
        convert(TokenOutput(token_ids=[], stop_reason="aborted"), sampling)
    # No logprobs asked: 0.0 each. The weight version: the oldest global step.
    generation = convert(
        TokenOutput(token_ids=[1, 2], extra_fields={"global_steps": 9, "min_global_steps": 8}), sampling
    )
    assert generation.logprobs == [0.0, 0.0] and generation.weight_version == 8
    assert convert(TokenOutput(token_ids=[1], log_probs=[-0.5]), sampling).weight_version is None


# --- tools mode -----------------------------------------------------------------------------------------


async def test_tools_mode_runs_bundled_tasks_from_veRL_dataset_rows(
    local_daemon, verl_tokenizer, tmp_path, monkeypatch
) -> None:
    rows = dataset_rows(tmp_path, verl_tokenizer, 4)
    tasks = load_tasks(BUNDLED)[:4]
    recorded = Recorded(monkeypatch)
    config = trainer_config()
    async with replay_server(tasks) as server:
        manager = ReferenceServerManager(server.url, global_steps=5)
        try:
            loops = [
                make_loop("corral", manager, verl_tokenizer, config=config, corral_address=local_daemon.address)
                for _ in rows
            ]
            outputs = await asyncio.gather(
                *(loop.run(dict(SAMPLING), uid=f"uid-{i}", **row) for i, (loop, row) in enumerate(zip(loops, rows)))
            )
        finally:
            await manager.close()

    assert [o.extra_fields["corral_task_id"] for o in outputs] == [t.task_id for t in tasks]
    for i, output in enumerate(outputs):
        result = recorded.results[output.extra_fields["corral_rollout_id"]]
        assert result.status == "completed" and is_token_exact(result) and result.group_id == f"uid-{i}"
        assert output.prompt_ids == result.prompt_ids and output.response_ids == result.response_ids
        assert output.response_mask == result.response_mask
        assert output.response_logprobs == result.response_logprobs
        assert len(output.response_ids) == len(output.response_mask) == len(output.response_logprobs)
        assert output.reward_score == result.reward == 1.0
        assert output.num_turns == 1 + len(result.turns) + (len(result.turns) - 1)  # no tool turn after submit
        assert output.metrics.generate_sequences == sum(t.llm_time_ms for t in result.turns) / 1000
        assert output.metrics.tool_calls == sum(t.tool_time_ms for t in result.turns) / 1000 > 0
        assert output.extra_fields | {"corral_rollout_id": None} == {
            "corral_rollout_id": None,
            "corral_task_id": result.task_id,
            "corral_status": "completed",
            "corral_filtered": False,
            "corral_filter_reason": None,
            "corral_error": "",
            "corral_finish_reason": "submitted",
            "corral_format_errors": 0,
            "corral_min_weight_version": 5,
            "corral_max_weight_version": 5,
            "corral_truncated_response_tokens": 0,
            "corral_truncated_prompt_tokens": 0,
            "min_global_steps": 5,
            "max_global_steps": 5,
        }
    # Generation went through veRL's server_manager: the rollout id as request id, veRL's sampling
    # parameters plus corral's per-turn max_tokens and end-of-turn stop ids.
    rollout_ids = {o.extra_fields["corral_rollout_id"] for o in outputs}
    assert {request_id for request_id, _ in manager.calls} == rollout_ids
    for _, params in manager.calls:
        assert params.items() >= SAMPLING.items() and "max_new_tokens" not in params
        assert 0 < params["max_tokens"] <= 1024 and 257 in params["stop_token_ids"]
    assert await task_sandboxes(local_daemon.address, *(t.task_id for t in tasks)) == []

    # veRL's own postprocessing pads and batches them; the reward lands on the last response token.
    worker = object.__new__(AgentLoopWorker)
    worker.rollout_config, worker.tokenizer, worker.processor = config.actor_rollout_ref.rollout, verl_tokenizer, None
    # No reward workers (corral scores): set around the attribute's declared type, which depends
    # on whether ray's annotations are installed.
    setattr(worker, "reward_loop_worker_handles", None)  # noqa: B010
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    padded = [
        await worker._agent_loop_postprocess(o.model_copy(deep=True), False, raw_prompt=row["raw_prompt"])
        for o, row in zip(outputs, rows)
    ]
    batch = worker._postprocess(padded)
    assert tuple(batch.batch["responses"].shape) == (4, 8192) and tuple(batch.batch["prompts"].shape) == (4, 4096)
    assert batch.batch["rm_scores"].sum(dim=1).tolist() == [1.0] * 4
    for i, output in enumerate(outputs):
        assert batch.batch["response_mask"][i].sum().item() == sum(output.response_mask)
        assert batch.batch["rm_scores"][i, len(output.response_ids) - 1].item() == 1.0
    assert list(batch.non_tensor_batch["corral_status"]) == ["completed"] * 4
    as_dict = outputs[0].as_dict()
    assert as_dict["rm_scores"][-1].item() == 1.0 and len(as_dict["rollout_log_probs"]) == len(outputs[0].response_ids)


async def test_tools_mode_with_vllm_stop_reasons_no_logprobs_and_a_short_response(
    local_daemon, verl_tokenizer, monkeypatch
) -> None:
    """vLLM says "completed", logprobs were not asked for (rollout.calculate_log_probs off), no
    global_steps; the response is longer than rollout.response_length."""
    task = repair_task("verl-vllm")
    recorded = Recorded(monkeypatch)
    row = {"extra_info": {"corral_task": task_to_json(task)}, "raw_prompt": []}
    async with replay_server([task]) as server:
        manager = ReferenceServerManager(server.url, style="vllm")
        try:
            loop = make_loop(
                "corral",
                manager,
                verl_tokenizer,
                config=trainer_config(response_length=40),
                corral_address=local_daemon.address,
                corral_tokenizer="byte",
            )
            output = await loop.run({**SAMPLING, "logprobs": False}, **row)
        finally:
            await manager.close()
    result = recorded.results[output.extra_fields["corral_rollout_id"]]
    assert result.status == "completed" and output.reward_score == 1.0
    assert [t.llm_finish_reason for t in result.turns] == ["stop"] * len(result.turns)
    assert output.response_logprobs is None  # not 0.0s posing as logprobs
    assert output.response_ids == result.response_ids[:40] and output.response_mask == result.response_mask[:40]
    assert output.extra_fields["corral_truncated_response_tokens"] == len(result.response_ids) - 40 > 0
    assert "min_global_steps" not in output.extra_fields  # veRL reported no global_steps
    assert output.extra_fields["corral_min_weight_version"] == 0  # corral stamped the trainer's policy version


async def test_a_filtered_rollout_is_masked_out_and_says_why(local_daemon, verl_tokenizer) -> None:
    bad_image = repair_task("verl-bad-image")
    bad_image.image = "/nonexistent/rootfs"
    row = {"extra_info": {"corral_task": task_to_json(bad_image)}}
    manager = ReferenceServerManager("http://127.0.0.1:9")  # never asked: the sandbox never starts
    loop = make_loop("corral", manager, verl_tokenizer, corral_address=local_daemon.address)
    output = await loop.run(dict(SAMPLING), **row)
    explicit = make_loop("corral", manager, verl_tokenizer, corral_address=local_daemon.address, filtered_reward=0.0)
    scored = await explicit.run(dict(SAMPLING), **row)
    await manager.close()
    assert output.reward_score is None and scored.reward_score == 0.0
    assert output.extra_fields["corral_filtered"] is True and output.extra_fields["corral_status"] == "filtered"
    assert output.extra_fields["corral_filter_reason"] == "sandbox_start"
    assert "/nonexistent/rootfs" in output.extra_fields["corral_error"]
    assert output.prompt_ids == ByteChatTokenizer().encode_prompt(
        [{"role": m.role, "content": m.content.replace("{file}", "calc.py")} for m in bad_image.prompt.messages]
    )
    assert output.response_ids == output.response_mask == output.response_logprobs == [] and manager.calls == []


async def test_a_failing_engine_filters_the_rollout_and_frees_its_sandbox(local_daemon, verl_tokenizer) -> None:
    task = repair_task("verl-engine-down")
    manager = ReferenceServerManager("http://127.0.0.1:9", fail=RuntimeError("the engine died"))
    loop = make_loop("corral", manager, verl_tokenizer, corral_address=local_daemon.address)
    output = await loop.run(dict(SAMPLING), extra_info={"corral_task": task_to_json(task)})
    await manager.close()
    assert output.extra_fields["corral_filter_reason"] == "llm_unreachable"
    assert "the engine died" in output.extra_fields["corral_error"] and output.reward_score is None
    assert len(manager.calls) == 1 and output.prompt_ids and not any(output.response_mask)
    assert await task_sandboxes(local_daemon.address, "verl-engine-down") == []


async def test_cancelling_the_agent_loop_frees_its_sandbox(local_daemon, verl_tokenizer) -> None:
    task = repair_task("verl-cancel")
    async with replay_server([task], latency_s=30.0) as server:
        manager = ReferenceServerManager(server.url)
        loop = make_loop("corral", manager, verl_tokenizer, corral_address=local_daemon.address)
        running = asyncio.create_task(loop.run(dict(SAMPLING), extra_info={"corral_task": task_to_json(task)}))
        for _ in range(200):
            if manager.calls:  # the sandbox is up and the first generation is under way
                break
            await asyncio.sleep(0.05)
        assert manager.calls and await task_sandboxes(local_daemon.address, "verl-cancel")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert await task_sandboxes(local_daemon.address, "verl-cancel") == []
        await manager.close()


# --- the converter --------------------------------------------------------------------------------------


def test_the_converter_cuts_prompt_and_response_as_veRL_does() -> None:
    result = RolloutResult(
        rollout_id="r",
        task_id="t",
        group_id="g",
        sample_index=0,
        status="completed",
        filter_reason=None,
        error="",
        reward=0.5,
        finish_reason="max_turns",
        prompt_ids=list(range(10)),
        response_ids=[1, 2, 3, 4],
        response_mask=[1, 1, 0, 1],
        response_logprobs=[-0.1, -0.2, 0.0, -0.4],
        weight_versions=[3, 3, -1, 4],
        turns=[],
        messages=[],
        timings={},
        format_errors=1,
        eval_output=b"",
        metadata={},
    )
    output = adapter.to_agent_loop_output(result, 3, prompt_length=8)
    assert isinstance(output, AgentLoopOutput)
    assert output.prompt_ids == list(range(2, 10)) and output.response_ids == [1, 2, 3]
    assert output.response_mask == [1, 1, 0] and output.response_logprobs == [-0.1, -0.2, 0.0]
    assert output.extra_fields["corral_truncated_prompt_tokens"] == 2
    assert output.extra_fields["corral_truncated_response_tokens"] == 1
    assert output.reward_score == 0.5 and output.num_turns == 1
    cancelled = adapter.to_agent_loop_output(dataclasses.replace(result, status="cancelled"), filtered_reward=-1.0)
    assert cancelled.reward_score == -1.0 and cancelled.response_mask == [0, 0, 0, 0]
    assert cancelled.extra_fields["corral_filtered"] is True


# --- service mode ---------------------------------------------------------------------------------------


class LoadBalancerStub:
    """veRL's load balancer actor as the service loop reads it (`get_all_servers.remote()`)."""

    def __init__(self, servers: list[str]) -> None:
        async def all_servers() -> list[str]:
            return servers

        self.get_all_servers = type("Method", (), {"remote": staticmethod(all_servers)})()


async def test_service_mode_runs_rollouts_against_veRLs_servers(local_daemon, verl_tokenizer) -> None:
    tasks = [repair_task("verl-service-a"), repair_task("verl-service-b"), repair_task("verl-service-c")]
    async with replay_server(tasks) as server:
        host_port = server.url.removeprefix("http://")
        try:
            listed = make_loop(
                "corral_service",
                object(),
                verl_tokenizer,
                corral_address=local_daemon.address,
                corral_servers=[server.url],
            )
            manager = type("Manager", (), {"_load_balancer": LoadBalancerStub([host_port])})()
            discovered = make_loop("corral_service", manager, verl_tokenizer, corral_address=local_daemon.address)
            assert await discovered.servers() == [host_port]
            outputs = await asyncio.gather(
                listed.run(dict(SAMPLING), extra_info={"corral_task": task_to_json(tasks[0])}),
                discovered.run({**SAMPLING, "temperature": 0.0}, extra_info={"corral_task": task_to_json(tasks[1])}),
            )
            streamed = [
                pair
                async for pair in adapter.service_outputs(
                    [tasks[2]], [host_port], address=local_daemon.address, response_length=50
                )
            ]
        finally:
            async with AsyncClient(local_daemon.address) as client:
                for llm in await client.rollouts.list_llms():
                    await client.rollouts.remove_llm(llm.address)
    for output in outputs:
        assert output.reward_score == 1.0 and output.extra_fields["corral_status"] == "completed"
        assert len(output.response_ids) == len(output.response_mask) == len(output.response_logprobs)
        assert sum(output.response_mask) > 0 and output.num_turns > 1
    [(result, output)] = streamed
    assert result.reward == output.reward_score == 1.0
    assert output.response_ids == result.response_ids[:50] and output.response_mask == result.response_mask[:50]
    assert server.requests_served == sum(len(t.reference_solution) for t in tasks)
    assert await task_sandboxes(local_daemon.address, *(t.task_id for t in tasks)) == []
