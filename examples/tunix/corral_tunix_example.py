"""corral with tunix, both ways in, runnable on a CPU with no model.

Environment mode: bundled tasks run as `CorralTaskEnv` episodes through tunix's own
RolloutOrchestrator and `CorralCollectEngine` (what `with_corral_engine(GRPOLearner)` builds),
in "Token" mode, the dicts GRPOLearner trains on. Service mode: the daemon runs the same tasks
against an SGLang-protocol server registered with it, and `CorralRolloutSource` yields tunix
TrajectoryItems.

No JAX model is trained or loaded here: in environment mode a stand-in `model_call` answers with
each task's reference solution (corral's replay policy, reading the chat tunix renders), and in
service mode the built-in reference server plays the same policy. In a real run tunix's
learner supplies the model_call and the servers are your SGLang / vLLM engines.

    corral serve &     # or the systemd unit; needs root and bubblewrap (see `corral doctor`)
    .venv/bin/python examples/tunix/corral_tunix_example.py [--address unix:///run/corral/corral.sock]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import numpy as np
from tunix.generate.tokenizer_adapter import TokenizerAdapter
from tunix.rl.agentic.agents.model_agent import ModelAgent
from tunix.rl.agentic.parser.chat_template_parser.parser import QwenChatTemplateParser
from tunix.rl.agentic.pipeline.rollout_orchestrator import RolloutOrchestrator
from tunix.rl.agentic.utils import RolloutSyncLock
from tunix.rl.rollout.base_rollout import RolloutOutput

from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.rollout.tokenizer import END_OF_TEXT, IM_END, ByteChatTokenizer
from corral.sdk import AsyncClient, load_tasks
from corral.trainer_adapters.tunix import CorralCollectEngine, CorralRolloutSource, CorralTaskEnv, system_prompt

TASKS = Path(__file__).resolve().parent.parent / "tasks" / "repair.jsonl"


class ByteTokenizer(ByteChatTokenizer):
    """corral's byte-level ChatML tokenizer, with the methods tunix's TokenizerAdapter wants (a
    real run uses the model's Hugging Face tokenizer)."""

    bos_token, eos_token = "", END_OF_TEXT

    def encode(self, text, **kwargs):
        return super().encode(text)

    def decode(self, ids, **kwargs):
        return super().decode([int(i) for i in ids])

    def bos_id(self):
        return -1

    def eos_id(self):
        return self.special_ids[IM_END]

    def pad_id(self):
        return self.special_ids[END_OF_TEXT]


def replay_model_call(tasks, tokenizer, parser):
    """Stands in for the learner's model_call (tunix's JAX model): the replay policy answers with
    the next call of the task's reference solution."""
    policy = ReplayPolicy(tasks)

    def model_call(chat_completions, env=None, max_generation_steps=None, **kwargs):
        if env is not None:
            env.task["policy_version"] = 0  # the learner's _model_call stamps its policy version
        prompt_ids = tokenizer.encode(
            parser.parse(messages=chat_completions, add_generation_prompt=True, is_first_msg=True)
        )
        _, answer = policy.answer(prompt_ids)
        return RolloutOutput(
            text=[tokenizer.decode(answer[:-1])],
            logits=[],
            tokens=[np.asarray(answer)],
            left_padded_prompt_tokens=np.asarray([prompt_ids]),
            logprobs=[np.zeros(len(answer), dtype=np.float32)],
        )

    return model_call


async def environment_mode(lines: list[str], address: str | None) -> None:
    tokenizer = TokenizerAdapter(ByteTokenizer())
    parser = QwenChatTemplateParser(tokenizer)
    tasks = [CorralTaskEnv({"corral_task": line}).corral_task for line in lines]
    orchestrator = RolloutOrchestrator(
        rollout_sync_lock=RolloutSyncLock(),
        engine_cls=CorralCollectEngine,
        max_concurrency=4,
        engine_kwargs={
            "model_call": replay_model_call(tasks, tokenizer, parser),
            "tokenizer": tokenizer,
            "chat_parser": parser,
        },
    )
    # What the learner does per example: one (agent, env) pair per generation.
    pairs = []
    for group_id, line in enumerate(lines):
        env = CorralTaskEnv({"corral_task": line}, group_id=group_id, pair_index=0, address=address)
        pairs.append((ModelAgent(system_prompt=system_prompt(env.corral_task)), env))
    producer = asyncio.create_task(
        orchestrator.run_producers_from_stream(
            pairs, group_size=1, group_key_fn=lambda i, env, traj: env.extra_kwargs["group_id"], collect_mode="Token"
        )
    )
    await asyncio.sleep(0)
    async for batch in orchestrator.yield_batches(batch_size=1):
        for item in batch:
            traj = item.traj
            print(
                f"  env mode     {tasks[item.group_id].task_id:28} status={traj['status']:9} "
                f"reward={traj['trajectory_reward']:.2f} tokens={len(traj['conversation_tokens'])} "
                f"trained-on={int(traj['conversation_masks'].sum())}"
            )
    await producer


async def service_mode(lines: list[str], address: str | None) -> None:
    tasks = [json.loads(line) for line in lines]
    server = ReferenceServer(ReplayPolicy(load_tasks(TASKS)))
    await server.start()
    try:
        async for item in CorralRolloutSource(tasks, servers=[server.url], address=address, n=2):
            traj = item.traj
            print(
                f"  service mode {traj['corral_task_id']:28} group={item.group_id} sample={item.pair_index} "
                f"status={traj['status']:9} reward={traj['trajectory_reward']:.2f} "
                f"tokens={len(traj['conversation_tokens'])} trained-on={int(traj['conversation_masks'].sum())}"
            )
    finally:
        async with AsyncClient(address) as client:  # the daemon keeps servers registered: take ours out
            await client.rollouts.remove_llm(server.url)
        await server.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", help="the corral daemon (default: $CORRAL_ADDRESS or the system socket)")
    parser.add_argument("--limit", type=int, default=3, help="how many bundled tasks to run (default 3)")
    args = parser.parse_args()
    lines = TASKS.read_text(encoding="utf-8").splitlines()[: args.limit]
    print("environment mode: tunix runs the agent loop, corral the sandboxes")
    await environment_mode(lines, args.address)
    print("service mode: the daemon runs the rollouts against a registered server")
    await service_mode(lines, args.address)


if __name__ == "__main__":
    asyncio.run(main())
