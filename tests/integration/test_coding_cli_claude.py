"""Claude Code (the real `claude` binary of @anthropic-ai/claude-code) solves every bundled repair
task inside the rollout's sandbox, network off, through the daemon's LLM gateway in Anthropic's
Messages API, against the built-in reference server playing each task's reference solution in
Claude Code's own tools (the replay policy with the `claude` vocabulary: Edit, Bash, then a
final reply without tool calls).

The CLIs are installed under CODING_CLIS_PREFIX on the node; the daemon's `local.host_paths`
shows that prefix read-only in every `host` sandbox. The sandbox's network is off (the default):
the gateway is reached on the sandbox's own loopback, and nothing else can be.

Checked per task: reward 1.0; the trajectory token-exact against what the engine itself received
and generated; one gateway call per turn and no other call (no count_tokens, title or quota
calls: `calls` is the turns the solution needs), every later call's prompt the recorded ids plus
Claude Code's new messages re-rendered exactly (prefix hits, no splice, no split).

Then Claude Code's own history rewrite, under each history policy: it fills in its tools' defaults
in the assistant messages it sends back, so an Edit call generated without `replace_all` comes
back changed, and the call after it is new.
"""

from __future__ import annotations

from tests.conftest import CODING_CLIS_PREFIX, require_coding_cli

require_coding_cli("claude")

import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from corral.rollout.coding_clis import with_coding_cli  # noqa: E402
from corral.rollout.reference.policies import GenerateParams, PolicyOutput  # noqa: E402
from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.reference.server import ReferenceServer, load_tasks_jsonl  # noqa: E402
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary  # noqa: E402
from corral.rollout.types import ToolCall  # noqa: E402
from corral.sdk import AsyncClient, RolloutResult  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.conftest import DaemonProcess, require_backend, shared_daemon_config  # noqa: E402

# Its own daemon: the local backend with bubblewrap. The 25 rollouts take about 6 s of CPU each
# (Claude Code itself 1.3 s): 167 s at load 12 on the 2-core development machine, 14 min at load 36-50,
# past the suite's 300 s per test.
pytestmark = [pytest.mark.above_backend, pytest.mark.timeout(1800)]

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
WORKDIR = "/workspace"  # the sandbox's workdir, where the harness runs
# Claude Code's first prompt is about 49,000 byte-tokenizer ids (its system prompt and 12 tools).
MAX_TOTAL_TOKENS = 131072
# Claude Code processes at once (each a 400 MB native binary starting up).
IN_FLIGHT = 4


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
    require_backend("local")
    root = tmp_path_factory.mktemp("daemon-claude")
    shown = json.dumps([os.path.realpath(CODING_CLIS_PREFIX)])
    config = root / "corral.toml"
    config.write_text(
        shared_daemon_config(
            f'[rollout]\nllm_unavailable_wait_s = 2\n[local]\nisolation = "bwrap"\nhost_paths = {shown}\n'
        )
    )
    proc = DaemonProcess(root, "--config", str(config)).start()
    yield proc
    proc.stop()


def claude_tasks() -> list[pb.Task]:
    tasks = []
    for task in load_tasks_jsonl(REPAIR_TASKS):
        harnessed = with_coding_cli(task, "claude", CODING_CLIS_PREFIX)
        harnessed.limits.max_total_tokens = MAX_TOTAL_TOKENS
        tasks.append(harnessed)
    return tasks


async def run_all(client: AsyncClient, tasks: list[pb.Task], policy: RecordingReplay) -> list[RolloutResult]:
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def feed() -> AsyncIterator[pb.Task]:
        for task in tasks:
            await slots.acquire()
            yield task

    server = ReferenceServer(policy)
    await server.start()
    info = await client.rollouts.register_llm(server.url)
    results = []
    try:
        async for result in client.rollouts.stream(feed()):
            results.append(result)
            slots.release()
    finally:
        await client.rollouts.remove_llm(info.address)
        await server.stop()
    return results


def check_solved_token_exact(
    result: RolloutResult, task: pb.Task, exchanges: list[tuple[list[int], list[int]]]
) -> None:
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    # One call per reference call, then the final reply (text, no tool calls).
    assert len(exchanges) == len(task.reference_solution), result.task_id
    names = [[call.name for call in turn.tool_calls] for turn in result.turns]
    expected = [["Edit" if c.name == "editor" else "Bash"] for c in task.reference_solution if c.name != "submit"]
    assert names == [*expected, []], result.task_id
    assert result.turns[-1].generated_ids[:-1] == list(FINAL_TEXT.encode())  # then <|im_end|>
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


async def test_claude_code_solves_every_bundled_task_token_exact_in_a_sandbox_without_network(daemon) -> None:
    tasks = claude_tasks()  # their sandboxes have no network (a task cannot ask for one)
    policy = RecordingReplay(ReplayPolicy(tasks, vocabulary=vocabulary("claude"), workdir=WORKDIR))
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        check_solved_token_exact(result, by_id[result.task_id], policy.exchanges[result.task_id])


class EditWithoutDefaults:
    """Claude Code's vocabulary, but Edit calls written without `replace_all` (as a model may)."""

    name = "claude-without-defaults"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | str:
        answer = vocabulary("claude").answer(call, workdir)
        if isinstance(answer, ToolCall) and answer.name == "Edit":
            return ToolCall("Edit", {k: v for k, v in answer.arguments.items() if k != "replace_all"})
        return answer


async def test_claude_code_s_rewritten_history_under_split_mask_and_fail(daemon) -> None:
    # accounts-super-init: Edit, Bash, the final reply. Claude Code sends the Edit back with
    # replace_all added, so the Bash call's conversation does not extend the recorded one.
    (task,) = [t for t in load_tasks_jsonl(REPAIR_TASKS) if t.task_id == "accounts-super-init"]
    tasks = []
    for policy_name in ("SPLIT", "MASK", "FAIL"):
        harnessed = with_coding_cli(
            task, "claude", CODING_CLIS_PREFIX, history_policy=pb.HistoryPolicy.Value(f"HISTORY_POLICY_{policy_name}")
        )
        harnessed.task_id = f"{task.task_id}-{policy_name.lower()}"
        harnessed.prompt.messages[-1].content += f" ({policy_name.lower()})"  # the replay policy tells them apart
        harnessed.limits.max_total_tokens = MAX_TOTAL_TOKENS
        tasks.append(harnessed)
    policy = RecordingReplay(ReplayPolicy(tasks, vocabulary=EditWithoutDefaults(), workdir=WORKDIR))
    async with AsyncClient(daemon.address) as client:
        results = {r.task_id.rsplit("-", 1)[1]: r for r in await run_all(client, tasks, policy)}
    split, mask, fail = results["split"], results["mask"], results["fail"]
    for result in (split, mask):
        # Two samples: the Edit call's, then the rest from the conversation as Claude Code sent it.
        assert (result.status, result.reward) == ("completed", 1.0), result.error
        assert result.gateway is not None and len(result.extra_samples) == 1
        assert (result.gateway.calls, result.gateway.prefix_hits, result.gateway.splits) == (3, 1, 1)
    assert split.gateway is not None and mask.gateway is not None
    assert split.gateway.masked_samples == 0 and any(split.response_mask)
    assert mask.gateway.masked_samples == 2
    assert not any(mask.response_mask) and not any(mask.extra_samples[0].response_mask)
    # FAIL: the second call is refused (409, which Claude Code is told not to retry), the CLI
    # exits, and the rollout is filtered.
    assert (fail.status, fail.filter_reason) == ("filtered", "history_rewritten"), fail.error
    assert len(policy.exchanges[f"{task.task_id}-fail"]) == 1
