"""Gemini CLI (@google/gemini-cli, the real npm package) solves every bundled repair task as a
harness task inside a local sandbox with its network off, through the rollout service: it speaks
Gemini's streamGenerateContent to the daemon's gateway on the sandbox's loopback, which forwards
token ids to the reference server playing each task's reference solution in the CLI's own tools
(the replay policy with the `gemini` vocabulary: `replace`, `run_shell_command`, then a final
reply without tool calls).

Checked per task: reward 1.0; the trajectory is token-exact against what the engine received and
generated (prompt_ids + response_ids = its last prompt plus its output, every call at its place,
mask 1 exactly on generated ids); the gateway's counters: one call per reference call (the final
submit being a reply without tool calls), none of them a side call of the CLI (its model router
is skipped because a model is named; see rollout/coding_clis/gemini.py), every call after the
first a prefix hit, no splice, split or discarded reply. Before the CLI starts, each harness
checks that the reference server, listening on the node's loopback, cannot be reached from the
sandbox: the CLI reaches only the gateway.

The CLIs are installed under CORRAL_CODING_CLIS (default /opt/corral-clis), shown read-only in
every `host` sandbox (`local.host_paths`); node comes from the host's /usr.
"""

from __future__ import annotations

from tests.conftest import CODING_CLIS_PREFIX, require_coding_cli

require_coding_cli("gemini")

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import AsyncIterator, Iterator, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from corral.rollout.coding_clis import with_coding_cli  # noqa: E402
from corral.rollout.reference.policies import GenerateParams, PolicyOutput  # noqa: E402
from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.reference.server import ReferenceServer, load_tasks_jsonl  # noqa: E402
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary  # noqa: E402
from corral.sdk import AsyncClient, RolloutResult  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.conftest import DaemonProcess, require_backend, shared_daemon_config  # noqa: E402

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
WORKDIR = "/workspace"  # the sandboxes' working directory (the daemon's default), where the CLI runs
# The CLI's system prompt and tool declarations are about 50,000 bytes: byte-tokenizer tokens.
MAX_TOTAL_TOKENS = 1 << 17
# CLIs at once: each node process takes about a second of CPU to start.
IN_FLIGHT = 4
# Exits 5 when the URL in $PROBE_URL answers: run before the CLI, it shows that the sandbox
# reaches nothing on the node but the gateway.
PROBE = (
    "import os, sys, urllib.request\n"
    "try:\n    urllib.request.urlopen(os.environ['PROBE_URL'], timeout=3)\n"
    "except OSError:\n    sys.exit(0)\n"
    "print(os.environ['PROBE_URL'], 'is reachable from the sandbox', file=sys.stderr)\nsys.exit(5)\n"
)


class RecordingReplay:
    """The replay policy behind the reference server, keeping per task each (prompt ids, output
    ids) the engine received and answered, in order."""

    name = "replay"

    def __init__(self, replay: ReplayPolicy) -> None:
        self.replay = replay
        self.weight_version = replay.weight_version
        self.exchanges: dict[str, list[tuple[list[int], list[int]]]] = defaultdict(list)

    async def generate(self, input_ids: list[int], params: GenerateParams) -> PolicyOutput:
        output = await self.replay.generate(input_ids, params)
        entry, _ = self.replay.find(self.replay.tokenizer.decode(input_ids))
        self.exchanges[entry.task_id].append((list(input_ids), list(output.output_ids)))
        return output

    async def load_weights(self, path: str, weight_version: int | None) -> int:
        return await self.replay.load_weights(path, weight_version)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """A local (bubblewrap) daemon whose `host` sandboxes show the CLIs' prefix read-only."""
    require_backend("local")
    root = tmp_path_factory.mktemp("daemon-gemini-cli")
    config = root / "corral.toml"
    config.write_text(
        shared_daemon_config(
            "[rollout]\nllm_unavailable_wait_s = 2\n"
            f'[local]\nisolation = "bwrap"\nhost_paths = {json.dumps([os.path.realpath(CODING_CLIS_PREFIX)])}\n'
        )
    )
    proc = DaemonProcess(root, "--config", str(config)).start()
    yield proc
    proc.stop()


def gemini_tasks(probe_url: str) -> list[pb.Task]:
    tasks = []
    for task in load_tasks_jsonl(REPAIR_TASKS):
        task.limits.max_total_tokens = MAX_TOTAL_TOKENS
        task = with_coding_cli(task, "gemini", CODING_CLIS_PREFIX)
        command = list(task.harness.command)
        del task.harness.command[:]
        task.harness.command.extend(["sh", "-c", 'python3 -c "$PROBE" && exec "$@"', "probe", *command])
        task.harness.env.update({"PROBE": PROBE, "PROBE_URL": probe_url})
        tasks.append(task)
    return tasks


async def run_all(client: AsyncClient, tasks: Sequence[pb.Task], server: ReferenceServer) -> list[RolloutResult]:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def feed() -> AsyncIterator[pb.Task]:
        for task in tasks:
            await slots.acquire()
            yield task

    info = await client.rollouts.register_llm(server.url)
    results = []
    try:
        async for result in client.rollouts.stream(feed()):
            results.append(result)
            slots.release()
    finally:
        await client.rollouts.remove_llm(info.address)
    return results


def check_solved_token_exact(
    result: RolloutResult, task: pb.Task, exchanges: list[tuple[list[int], list[int]]]
) -> None:
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    # One call per reference call, the last one (submit) the final reply without tool calls.
    assert len(exchanges) == len(task.reference_solution), result.task_id
    names = [call.name for turn in result.turns for call in turn.tool_calls]
    expected = [
        "run_shell_command" if call.name == "bash" else "replace"
        for call in task.reference_solution
        if call.name != "submit"
    ]
    assert names == expected, result.task_id
    assert result.turns[-1].tool_calls == [] and result.messages[-1]["content"].endswith(FINAL_TEXT)
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


# The 25 tasks took 706 s (572 CPU-seconds, the daemon's sandboxes and evaluations included; the
# CLI about 3.5 of them per task) on the 2-core development machine at load average 8 to 27.
@pytest.mark.timeout(1800)
async def test_gemini_cli_in_a_sandbox_without_network_solves_every_repair_task_token_exact(daemon) -> None:
    policy = RecordingReplay(
        ReplayPolicy(load_tasks_jsonl(REPAIR_TASKS), vocabulary=vocabulary("gemini"), workdir=WORKDIR)
    )
    server = ReferenceServer(policy)
    await server.start()
    try:
        tasks = gemini_tasks(server.url + "/health")
        async with AsyncClient(daemon.address) as client:
            results = await run_all(client, tasks, server)
    finally:
        await server.stop()
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        check_solved_token_exact(result, by_id[result.task_id], policy.exchanges[result.task_id])
