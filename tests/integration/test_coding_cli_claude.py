"""Claude Code (the real `claude` binary of @anthropic-ai/claude-code) solves every bundled repair
task inside the rollout's sandbox, network off, through the daemon's LLM gateway in Anthropic's
Messages API (`make test` runs a fifth of them: coding_cli_support.py), against the built-in reference server playing each task's reference solution in
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

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from corral.rollout.coding_clis import with_coding_cli  # noqa: E402
from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.reference.server import load_tasks_jsonl  # noqa: E402
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary  # noqa: E402
from corral.rollout.types import ToolCall  # noqa: E402
from corral.sdk import AsyncClient  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.conftest import DaemonProcess  # noqa: E402
from tests.integration.coding_cli_support import (  # noqa: E402
    MAX_TOTAL_TOKENS,
    REPAIR_TASKS,
    WORKDIR,
    check_token_exact,
    cli_daemon,
    cli_tasks,
)
from tests.integration.replay_rollouts import (  # noqa: E402
    RecordingReplay,
    run_all,
)

# Its own daemon: the local backend with bubblewrap. The 25 rollouts take about 6 s of CPU each
# (Claude Code itself 1.3 s): 167 s at load 12 on the 2-core development machine, 14 min at load 36-50,
# past the suite's 300 s per test.
pytestmark = [pytest.mark.above_backend, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    yield from cli_daemon(tmp_path_factory.mktemp("daemon-claude"))


async def test_claude_code_solves_the_bundled_tasks_token_exact_in_a_sandbox_without_network(daemon) -> None:
    tasks = cli_tasks("claude")  # their sandboxes have no network (a task cannot ask for one)
    policy = RecordingReplay(ReplayPolicy(tasks, vocabulary=vocabulary("claude"), workdir=WORKDIR))
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        task = by_id[result.task_id]
        check_token_exact(result, task, policy.exchanges[result.task_id])
        names = [[call.name for call in turn.tool_calls] for turn in result.turns]
        expected = [["Edit" if c.name == "editor" else "Bash"] for c in task.reference_solution if c.name != "submit"]
        assert names == [*expected, []], result.task_id
        assert result.turns[-1].generated_ids[:-1] == list(FINAL_TEXT.encode())  # then <|im_end|>


class EditWithoutDefaults:
    """Claude Code's vocabulary, but Edit calls written without `replace_all` (as a model may)."""

    name = "claude-without-defaults"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | list[ToolCall] | str:
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
