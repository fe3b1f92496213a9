"""Rollouts of bundled tasks against the replay policy, recorded: the reference server playing a
policy that keeps, per task, each (prompt ids, output ids) the engine received and answered; tasks
run through the rollout service a few at a time; and the check that a rollout is one token-exact
sample of those exchanges. Shared by the harness tests (mini-swe-agent's, the coding CLIs')."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence

from corral.rollout.reference.policies import GenerateParams, PolicyOutput
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer
from corral.sdk import AsyncClient, RolloutResult
from corral.v1 import rollout_pb2 as pb

# Rollouts at once, by default.
IN_FLIGHT = 4
Exchanges = list[tuple[list[int], list[int]]]


class RecordingReplay:
    """The replay policy behind the reference server, keeping per task each (prompt ids, output
    ids) the engine received and answered, in order."""

    name = "replay"

    def __init__(self, replay: ReplayPolicy) -> None:
        self.replay = replay
        self.weight_version = replay.weight_version
        self.exchanges: dict[str, Exchanges] = defaultdict(list)

    async def generate(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        output = await self.replay.generate(input_ids, params)
        entry, _ = self.replay.find(self.replay.tokenizer.decode(input_ids))
        self.exchanges[entry.task_id].append((list(input_ids), list(output.output_ids)))
        return output

    async def load_weights(self, path: str, weight_version: int | None) -> int:
        return await self.replay.load_weights(path, weight_version)

    def prompt_text(self, task_id: str, index: int = -1) -> str:
        return self.replay.tokenizer.decode(self.exchanges[task_id][index][0])


@contextlib.asynccontextmanager
async def serving(client: AsyncClient, policy: RecordingReplay, *, port: int = 0) -> AsyncIterator[str]:
    """The reference server playing `policy` (on `port` of the node's loopback; 0: any free one),
    registered with the daemon; yields its URL."""
    server = ReferenceServer(policy, port=port)
    await server.start()
    try:
        info = await client.rollouts.register_llm(server.url)
        try:
            yield server.url
        finally:
            await client.rollouts.remove_llm(info.address)
    finally:
        await server.stop()


async def run_tasks(
    client: AsyncClient, tasks: Sequence[pb.Task], *, in_flight: int = IN_FLIGHT
) -> list[RolloutResult]:
    """Every task through the rollout service, `in_flight` at a time; results in completion order."""
    slots = asyncio.Semaphore(in_flight)

    async def feed() -> AsyncIterator[pb.Task]:
        for task in tasks:
            await slots.acquire()
            yield task

    results = []
    async for result in client.rollouts.stream(feed()):
        results.append(result)
        slots.release()
    return results


async def run_all(
    client: AsyncClient, tasks: Sequence[pb.Task], policy: RecordingReplay, *, port: int = 0, in_flight: int = IN_FLIGHT
) -> list[RolloutResult]:
    """Every task through the daemon against a reference server playing `policy`."""
    async with serving(client, policy, port=port):
        return await run_tasks(client, tasks, in_flight=in_flight)


def check_one_token_exact_sample(result: RolloutResult, exchanges: Exchanges) -> None:
    """The rollout is one sample, token-exact against what the engine received and answered:
    prompt + response is its last prompt plus its output, every earlier call at its place, mask 1
    exactly on generated ids; every call after the first a prefix hit, nothing spliced, split or
    discarded."""
    full = result.prompt_ids + result.response_ids
    last_prompt, last_output = exchanges[-1]
    assert full == last_prompt + last_output
    assert result.prompt_ids == exchanges[0][0]
    expected_mask = [0] * len(result.response_ids)
    for prompt, output in exchanges:
        assert full[: len(prompt)] == prompt
        assert full[len(prompt) : len(prompt) + len(output)] == output
        for position in range(len(prompt), len(prompt) + len(output)):
            expected_mask[position - len(result.prompt_ids)] = 1
    assert result.response_mask == expected_mask
    assert [turn.generated_ids for turn in result.turns] == [output for _, output in exchanges]
    assert result.gateway is not None
    assert (result.gateway.calls, result.gateway.prefix_hits) == (len(exchanges), len(exchanges) - 1)
    assert (result.gateway.splices, result.gateway.splits, result.gateway.discarded) == (0, 0, 0)
    assert result.extra_samples == []
