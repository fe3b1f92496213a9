"""The tunix adapter against the real tunix package and a real daemon.

Environment mode runs through tunix's own machinery (TrajectoryCollectEngine, ModelAgent, the
RolloutOrchestrator a GRPOLearner builds) with a model_call that stands in for tunix's JAX model:
no model is trained here, so corral's replay policy reads the chat tunix renders and answers with
the next call of the task's reference solution. Service mode runs against the built-in reference
server (replay policy) registered with the daemon.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.conftest import require_trainer

require_trainer("tunix", "tunix", "tunix")

from google.protobuf import json_format  # noqa: E402
from tunix.generate.tokenizer_adapter import TokenizerAdapter  # noqa: E402
from tunix.rl.agentic.agentic_grpo_learner import GRPOLearner  # noqa: E402
from tunix.rl.agentic.agents.agent_types import TrajectoryItem, TrajectoryStatus  # noqa: E402
from tunix.rl.agentic.agents.model_agent import ModelAgent  # noqa: E402
from tunix.rl.agentic.parser.chat_template_parser.parser import QwenChatTemplateParser  # noqa: E402
from tunix.rl.agentic.trajectory.trajectory_collect_engine import TrajectoryCollectEngine  # noqa: E402
from tunix.rl.agentic.utils import RolloutSyncLock  # noqa: E402
from tunix.rl.rollout.base_rollout import RolloutOutput  # noqa: E402

from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.tokenizer import END_OF_TEXT, IM_END, ByteChatTokenizer  # noqa: E402
from corral.sdk import AsyncClient, InvalidArgument  # noqa: E402
from corral.trainer_adapters.tunix import (  # noqa: E402
    CorralCollectEngine,
    CorralEnvError,
    CorralRolloutSource,
    CorralTaskEnv,
    corral_task_of,
    system_prompt,
    with_corral_engine,
)
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.rollout_tasks import call, repair_task, replay_server  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_LINES = {
    json.loads(line)["task_id"]: line
    for line in (ROOT / "examples" / "tasks" / "repair.jsonl").read_text().splitlines()
}
# One of each reward rule: exit_status and printed_number.
EXAMPLE_IDS = ("accounts-super-init", "bitflags-clear-toggle", "pager-first-page")
POLICY_VERSION = 3
LOGPROB = -0.25


class ByteTokenizer(ByteChatTokenizer):
    """corral's byte-level ChatML tokenizer with the methods tunix's TokenizerAdapter asks for."""

    bos_token = ""
    eos_token = END_OF_TEXT

    def encode(self, text: str, **kwargs) -> list[int]:
        return super().encode(text)

    def decode(self, ids, **kwargs) -> str:
        return super().decode([int(i) for i in ids])

    def bos_id(self) -> int:
        return -1  # none: nothing to deduplicate

    def eos_id(self) -> int:
        return self.special_ids[IM_END]

    def pad_id(self) -> int:
        return self.special_ids[END_OF_TEXT]


TOKENIZER = TokenizerAdapter(ByteTokenizer())
PARSER = QwenChatTemplateParser(TOKENIZER)  # ChatML, as the replay policy reads it


class ReplayModelCall:
    """Stands in for tunix's JAX model (none is trained in these tests): renders the chat as tunix
    does (chat parser, then tokenizer), and corral's replay policy answers with the next call of
    the task's reference solution. Sets env.task["policy_version"] as the learner's _model_call
    does. `replies` overrides the reply text for given turns."""

    def __init__(self, tasks, replies: dict[int, str] | None = None) -> None:
        self.policy = ReplayPolicy(list(tasks))
        self.replies = replies or {}
        self.calls = 0

    def __call__(self, chat_completions, env=None, max_generation_steps=None, **kwargs) -> RolloutOutput:
        self.calls += 1
        if env is not None:
            env.task["policy_version"] = POLICY_VERSION
        text = PARSER.parse(messages=chat_completions, add_generation_prompt=True, is_first_msg=True)
        prompt_ids = TOKENIZER.encode(text)
        turn = sum(1 for message in chat_completions if message["role"] == "assistant")
        if turn in self.replies:
            answer = TOKENIZER.encode(self.replies[turn]) + [TOKENIZER.eos_id()]
        else:
            _, answer = self.policy.answer(prompt_ids)
        return RolloutOutput(
            text=[TOKENIZER.decode(answer[:-1])],
            logits=[],
            tokens=[np.asarray(answer, dtype=np.int32)],
            left_padded_prompt_tokens=np.asarray([prompt_ids], dtype=np.int32),
            logprobs=[np.full(len(answer), LOGPROB, dtype=np.float32)],
        )


def example_task(task_id: str) -> pb.Task:
    return json_format.Parse(EXAMPLE_LINES[task_id], pb.Task())


def pair(example, address: str, *, group_id: int = 0, **env_kwargs):
    env = CorralTaskEnv(example, group_id=group_id, pair_index=0, address=address, **env_kwargs)
    return ModelAgent(system_prompt=system_prompt(env.corral_task)), env


async def live_sandboxes(address: str, task_id: str) -> list:
    async with AsyncClient(address) as client:
        return await client.list_sandboxes(labels={"io.corral.task": task_id})


def check_token_dict(traj: dict, *, logprob_marks_generated: bool = True) -> None:
    """Lengths line up; with the stand-in model (logprob -0.25 per token), generated tokens (mask
    1) are exactly those with a logprob (observations get 0.0)."""
    tokens, masks, logprobs = traj["conversation_tokens"], traj["conversation_masks"], traj["old_logprobs"]
    assert len(tokens) == len(masks) == len(logprobs) > 0
    assert len(traj["prompt_tokens"]) > 0
    assert set(np.unique(masks)) == {0, 1}
    if logprob_marks_generated:
        np.testing.assert_array_equal(logprobs != 0, masks == 1)


# -- environment mode --------------------------------------------------------------------------------


async def test_episodes_through_the_orchestrator_a_grpo_learner_builds(local_daemon) -> None:
    """Four tasks given four ways (JSONL text, the learner's batch of one, a dict, a message) run
    through the RolloutOrchestrator of with_corral_engine(GRPOLearner): reward 1.0 from corral's
    evaluation, token dicts as GRPOLearner reads them, no sandbox left."""
    tasks = [example_task(task_id) for task_id in EXAMPLE_IDS] + [repair_task("tunix-orchestrated")]
    examples = [
        {"corral_task": EXAMPLE_LINES[EXAMPLE_IDS[0]]},
        {"corral_task": np.array([EXAMPLE_LINES[EXAMPLE_IDS[1]]])},
        {"corral_task": json_format.MessageToDict(tasks[2])},
        {"corral_task": tasks[3]},
    ]
    model_call = ReplayModelCall(tasks)

    learner: Any = object.__new__(with_corral_engine(GRPOLearner))
    learner.tokenizer, learner.chat_parser = TOKENIZER, PARSER
    learner.algo_config = SimpleNamespace(
        episode_timeout=120.0, max_response_length=None, overlong_filter=False, filter_statuses=None, max_concurrency=4
    )
    learner.rl_cluster = SimpleNamespace(perf_v2=None)
    learner._rollout_sync_lock = RolloutSyncLock()
    learner._model_call = model_call
    orchestrator = learner._build_orchestrator()
    assert orchestrator.engine_cls is CorralCollectEngine

    pairs = [pair(example, local_daemon.address, group_id=i) for i, example in enumerate(examples)]
    producer = asyncio.create_task(
        orchestrator.run_producers_from_stream(
            pairs, group_size=1, group_key_fn=lambda i, env, traj: env.extra_kwargs["group_id"], collect_mode="Token"
        )
    )
    await asyncio.sleep(0)
    items = [item async for batch in orchestrator.yield_batches(batch_size=1) for item in batch]
    await producer

    assert sorted(item.group_id for item in items) == [0, 1, 2, 3]
    for item in items:
        assert isinstance(item, TrajectoryItem)
        traj = item.traj
        assert traj["status"] == "SUCCEEDED", traj.get("corral_error")
        assert traj["trajectory_reward"] == 1.0
        assert traj["policy_version"] == POLICY_VERSION and traj["group_id"] == item.group_id
        assert "corral_error" not in traj
        check_token_dict(traj)
        # One assistant turn per reference-solution call (the last is submit).
        task = tasks[item.group_id]
        assert sum(m["role"] == "assistant" for m in traj["conversation_text"]) == len(task.reference_solution)
    for task in tasks:
        assert await live_sandboxes(local_daemon.address, task.task_id) == []


async def test_steps_observe_real_tool_output_and_submit_ends_the_episode(local_daemon) -> None:
    task = repair_task("tunix-steps")
    # Turn 1 is replaced by a reply with no tool call: the model is told so, and the episode goes
    # on. (The replay policy answers turn k with reference_solution[k]: a placeholder keeps the
    # rest of the solution in step.)
    task.reference_solution.insert(1, call("bash", command="echo never-run"))
    model_call = ReplayModelCall([task], replies={1: "I think it is fixed."})
    agent, env = pair({"corral_task": task}, local_daemon.address)
    engine = TrajectoryCollectEngine(agent, env, model_call=model_call, tokenizer=TOKENIZER, chat_parser=PARSER)
    trajectory = await engine.collect("Trajectory")

    steps = trajectory.steps
    assert [step.done for step in steps] == [False, False, False, True]
    assert "Edited /workspace/calc.py" in steps[0].observation and "a + b" in steps[0].observation
    assert steps[0].info["tool_calls"] == ["editor"]
    assert steps[1].observation.startswith("Error: your reply has no tool call.") and steps[1].info["format_error"]
    assert steps[2].observation == "4\n"  # python3 -c 'import calc; print(calc.add(2, 2))', run by bash
    assert steps[3].observation is None and steps[3].reward == 1.0
    assert steps[3].info["finish_reason"] == "submitted" and steps[3].info["tool_calls"] == ["submit"]
    assert trajectory.status is TrajectoryStatus.SUCCEEDED and trajectory.reward == 1.0
    assert env.last_result["reward"] == 1.0
    # The observations reached the model as user messages.
    assert any(m["role"] == "user" and m["content"] == "4\n" for m in agent.chat_completions)
    assert await live_sandboxes(local_daemon.address, task.task_id) == []


async def test_max_steps_ends_and_evaluates_the_episode(local_daemon) -> None:
    task = repair_task("tunix-max-steps")
    agent, env = pair(task, local_daemon.address, max_steps=1)  # only the edit; no submit
    engine = TrajectoryCollectEngine(agent, env, model_call=ReplayModelCall([task]))
    trajectory = await engine.collect("Trajectory")
    assert len(trajectory.steps) == 1 and trajectory.steps[0].done
    assert trajectory.steps[0].info["finish_reason"] == "max_turns"
    assert trajectory.reward == 1.0  # the edit alone fixes it
    assert await live_sandboxes(local_daemon.address, task.task_id) == []


async def test_close_mid_episode_destroys_the_sandbox(local_daemon) -> None:
    task = repair_task("tunix-close")
    env = CorralTaskEnv({"corral_task": task}, address=local_daemon.address)
    observation, _ = await asyncio.to_thread(env.reset)
    assert observation == "[tunix-close] add() in calc.py is wrong; fix it."
    assert [s.id for s in await live_sandboxes(local_daemon.address, task.task_id)] == [env.sandbox_id]
    reply = '<tool_call>{"name": "bash", "arguments": {"command": "cat calc.py"}}</tool_call>'
    observation, reward, done, info = await asyncio.to_thread(env.step, reply)
    assert "return a - b" in observation and reward == 0.0 and not done
    await asyncio.to_thread(env.close)
    assert env.sandbox_id is None
    assert await live_sandboxes(local_daemon.address, task.task_id) == []
    await asyncio.to_thread(env.close)  # again: nothing to do


async def test_a_sandbox_gone_under_a_step_is_a_backend_crash(local_daemon) -> None:
    task = repair_task("tunix-gone")
    env = CorralTaskEnv(task, address=local_daemon.address)
    await asyncio.to_thread(env.reset)
    assert env.sandbox_id is not None
    async with AsyncClient(local_daemon.address) as client:
        await (await client.get_sandbox(env.sandbox_id)).destroy()
    reply = '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    with pytest.raises(CorralEnvError) as raised:
        await asyncio.to_thread(env.step, reply)
    assert raised.value.reason == "backend_crash" and env.sandbox_id is None
    await asyncio.to_thread(env.close)


async def test_a_hung_step_is_cut_by_tunix_and_close_frees_the_sandbox(local_daemon) -> None:
    """tunix's ENV_TIMEOUT path: env.step runs past the episode timeout, the engine abandons it and
    calls close(), which cancels the step and destroys the sandbox at once."""
    task = repair_task("tunix-hang")
    sleep = '<tool_call>{"name": "bash", "arguments": {"command": "sleep 60"}}</tool_call>'
    agent, env = pair(task, local_daemon.address)
    engine = TrajectoryCollectEngine(agent, env, model_call=ReplayModelCall([task], replies={0: sleep}), timeout=2.0)
    started = time.monotonic()
    trajectory = await engine.collect("Trajectory")
    assert trajectory.status is TrajectoryStatus.ENV_TIMEOUT
    assert time.monotonic() - started < 30
    assert await live_sandboxes(local_daemon.address, task.task_id) == []


async def test_a_failing_setup_is_filtered_not_reward_zero(local_daemon) -> None:
    task = repair_task("tunix-bad-setup")
    task.setup.commands.append("false")
    model_call = ReplayModelCall([task])

    # tunix's own engine: the failure is raised, not turned into a reward.
    agent, env = pair(task, local_daemon.address)
    with pytest.raises(CorralEnvError) as raised:
        await TrajectoryCollectEngine(agent, env, model_call=model_call).collect("Token")
    assert raised.value.reason == "sandbox_start" and "false" in str(raised.value)
    assert await live_sandboxes(local_daemon.address, task.task_id) == []

    # corral's engine: a FAILED trajectory that trains on nothing.
    agent, env = pair(task, local_daemon.address)
    traj = await CorralCollectEngine(
        agent, env, model_call=model_call, tokenizer=TOKENIZER, chat_parser=PARSER
    ).collect("Token")
    assert model_call.calls == 0  # the model never ran
    assert traj["status"] == TrajectoryStatus.FAILED.name
    assert traj["corral_error"]["corral_filter_reason"] == "sandbox_start"
    assert traj["trajectory_reward"] == 0.0 and not np.any(traj["conversation_masks"])
    assert len(traj["prompt_tokens"]) > 0
    assert await live_sandboxes(local_daemon.address, task.task_id) == []


async def test_an_evaluation_that_cannot_run_is_filtered(local_daemon) -> None:
    # A reward rule that cannot be applied (sealed observations, but the task expects none): the
    # task is broken, not the agent; EVAL_INFRA, not 0.
    task = repair_task("tunix-bad-eval", eval_command="true", reward="expected_observations")
    agent, env = pair(task, local_daemon.address)
    traj = await CorralCollectEngine(
        agent, env, model_call=ReplayModelCall([task]), tokenizer=TOKENIZER, chat_parser=PARSER
    ).collect("Token")
    assert traj["status"] == "FAILED" and traj["corral_error"]["corral_filter_reason"] == "eval_infra"
    assert len(traj["conversation_tokens"]) > 0 and not np.any(traj["conversation_masks"])
    assert await live_sandboxes(local_daemon.address, task.task_id) == []


def test_corral_task_of_unwraps_what_tunix_hands_over() -> None:
    task = repair_task("tunix-parse")
    line = json.dumps(json_format.MessageToDict(task))
    for value in (
        task,
        line,
        line.encode(),
        {"corral_task": line},
        {"corral_task": np.array([line])},
        np.array([{"corral_task": json.loads(line)}], dtype=object),
        [line],
    ):
        assert corral_task_of(value) == task
    for bad in ({"corral_task": np.array([line, line])}, {"corral_task": 3}, "{not json"):
        with pytest.raises(InvalidArgument):
            corral_task_of(bad)


def test_a_missing_tunix_is_a_clear_import_error() -> None:
    code = "import sys; sys.modules['tunix'] = None; import corral.trainer_adapters.tunix"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode != 0 and "pip install 'corral[tunix]'" in done.stderr


# -- service mode ------------------------------------------------------------------------------------


async def test_service_mode_yields_tunix_items_from_corral_results(local_daemon) -> None:
    tasks = [example_task(EXAMPLE_IDS[0]), repair_task("tunix-service")]
    bad = repair_task("tunix-service-bad-setup")
    bad.setup.commands.append("false")
    async with replay_server([*tasks, bad]) as server:
        try:
            source = CorralRolloutSource(
                [{"corral_task": EXAMPLE_LINES[EXAMPLE_IDS[0]]}, tasks[1], bad],
                servers=[server.url],
                address=local_daemon.address,
                n=2,
                first_group_id=10,
            )
            items = [item async for item in source]
            kept = [item async for item in CorralRolloutSource([bad], address=local_daemon.address, keep_filtered=True)]
        finally:
            async with AsyncClient(local_daemon.address) as client:
                for llm in await client.rollouts.list_llms():
                    await client.rollouts.remove_llm(llm.address)

    assert source.skipped == 2  # both samples of the task whose setup fails
    assert sorted((item.group_id, item.pair_index) for item in items) == [(10, 0), (10, 1), (11, 0), (11, 1)]
    for item in items:
        result, traj = item.metadata["corral_result"], item.traj
        assert traj["status"] == "SUCCEEDED" and traj["trajectory_reward"] == result.reward == 1.0
        check_token_dict(traj, logprob_marks_generated=False)  # the replay server's logprobs are 0.0
        np.testing.assert_array_equal(traj["conversation_masks"], result.response_mask)
        np.testing.assert_array_equal(traj["conversation_tokens"], result.response_ids)
        np.testing.assert_array_equal(traj["prompt_tokens"], result.prompt_ids)
        np.testing.assert_allclose(traj["old_logprobs"], result.response_logprobs)
        assert traj["policy_version"] == 0 and traj["group_id"] == item.group_id
        assert traj["conversation_text"] == result.messages
    assert items[0].traj["original_input"] is not None
    assert {item.traj["original_input"]["corral_task"] for item in items if item.group_id == 10} == {
        EXAMPLE_LINES[EXAMPLE_IDS[0]]
    }

    [failed] = kept
    assert failed.traj["status"] == "FAILED" and failed.traj["corral_filter_reason"] == "sandbox_start"
    assert failed.traj["trajectory_reward"] == 0.0 and not np.any(failed.traj["conversation_masks"])
    assert failed.group_id == 0
    for task in [*tasks, bad]:
        assert await live_sandboxes(local_daemon.address, task.task_id) == []
