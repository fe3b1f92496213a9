"""Codex CLI solves every bundled repair task as a harness task: the real `codex exec` (npm's
@openai/codex, its native binary) runs inside each rollout's local sandbox (bubblewrap, network
off: the gateway on the sandbox's loopback is all it reaches), talks OpenAI's Responses API to the
daemon's LLM gateway, and edits the task's files with its own tools, while the built-in reference
server plays each task's reference solution in Codex's vocabulary (exec_command, apply_patch as
a custom tool, a final reply without tool calls; rollout/reference/vocabularies/codex.py).

Checked per task: reward 1.0; one Codex call per reference call (the submit call is the final
reply); the sample is token-exact against what the engine itself received and generated (the
last prompt plus its output, every earlier call at its place, mask 1 exactly on generated ids);
the gateway's counters: every call after the first a prefix hit (Codex sends the whole history
back as the gateway returned it, with its call ids), no splice, no split, nothing discarded.

The CLIs' npm prefix (CORRAL_CODING_CLIS, /opt/corral-clis) is shown read-only in every sandbox
(`local.host_paths`); node, which runs npm's `codex` launcher, is the host image's. About 60 s
for the 25 tasks on a 2-core machine.

With the sandbox's network off (the default), Codex reaches only the gateway: with its plugin
sync turned back on, which at start runs `git ls-remote https://github.com/openai/plugins.git`
and queries api.github.com (seen with strace on the host), a task still completes token-exact,
while a probe in the same sandbox finds the outside unreachable and the gateway reachable.
"""

from __future__ import annotations

from tests.conftest import CODING_CLIS_PREFIX, require_backend, require_coding_cli

require_coding_cli("codex")

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
from tests.conftest import DaemonProcess, shared_daemon_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REPAIR_TASKS = REPO / "examples" / "tasks" / "repair.jsonl"
# Codex's system prompt and tool schemas are about 32,000 bytes: byte-tokenizer ids.
MAX_TOTAL_TOKENS = 1 << 17
# Codex processes at once (each also starts a login shell to snapshot its environment).
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
    """A local daemon (bubblewrap) that shows every sandbox the CLIs' prefix, read-only."""
    require_backend("local")
    root = tmp_path_factory.mktemp("daemon-codex")
    config = root / "corral.toml"
    shown = [os.path.realpath(CODING_CLIS_PREFIX)]
    config.write_text(shared_daemon_config(f'[local]\nisolation = "bwrap"\nhost_paths = {json.dumps(shown)}\n'))
    proc = DaemonProcess(root, "--config", str(config)).start()
    yield proc
    proc.stop()


def codex_tasks() -> list[pb.Task]:
    tasks = []
    for task in load_tasks_jsonl(REPAIR_TASKS):
        harnessed = with_coding_cli(task, "codex", CODING_CLIS_PREFIX)
        harnessed.limits.max_total_tokens = MAX_TOTAL_TOKENS
        harnessed.limits.max_new_tokens_per_turn = 4096
        tasks.append(harnessed)
    return tasks


async def run_all(client: AsyncClient, tasks: Sequence[pb.Task], policy: RecordingReplay) -> list[RolloutResult]:
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
    result: RolloutResult, task: pb.Task, exchanges: list[tuple[list[int], list[int]]], replay: ReplayPolicy
) -> None:
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    # One Codex call per reference call; the submit is Codex's final reply, without tool calls.
    assert len(exchanges) == len(task.reference_solution), result.task_id
    names = [[call.name for call in turn.tool_calls] for turn in result.turns]
    assert all(len(calls) == 1 and calls[0] in ("exec_command", "apply_patch") for calls in names[:-1]), names
    assert names[-1] == [] and replay.tokenizer.decode(exchanges[-1][1]).startswith(FINAL_TEXT)
    assert ["apply_patch"] in names, names  # every bundled edit is whole lines: a patch
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


# Run before Codex in the harness's sandbox: which addresses a connection reaches (into the
# workdir, which the evaluation sees).
PROBE = """python3 -c '
import os, socket, urllib.parse
def reach(host, port):
    try:
        socket.create_connection((host, port), 3).close()
        return "connected"
    except OSError as error:
        return "failed: %s" % error
gateway = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"])
with open(os.path.join(os.environ["CORRAL_WORKDIR"], "net-probe.txt"), "w") as out:
    out.write("outside-ip %s\\n" % reach("1.1.1.1", 443))
    out.write("outside-name %s\\n" % reach("github.com", 443))
    out.write("gateway %s\\n" % reach(gateway.hostname, gateway.port))
'"""


async def test_codex_reaches_only_the_gateway_with_the_network_off(daemon) -> None:
    (task,) = [task for task in codex_tasks() if task.task_id == "accounts-super-init"]
    script = task.harness.command[2].replace(" exec ", " exec --enable plugins --enable remote_plugin ", 1)
    task.harness.command[2] = f"{PROBE}; {script}"
    # Evaluated in a fresh sandbox with the workdir's changes: the probe's file is one of them.
    task.evaluation.commands.insert(0, "cat net-probe.txt")
    replay = ReplayPolicy([task], vocabulary=vocabulary("codex"))
    policy = RecordingReplay(replay)
    async with AsyncClient(daemon.address) as client:
        (result,) = await run_all(client, [task], policy)
    check_solved_token_exact(result, task, policy.exchanges[task.task_id], replay)
    probe = result.eval_output.decode()
    assert "outside-ip failed:" in probe and "outside-name failed:" in probe, probe
    assert "gateway connected" in probe, probe


async def test_codex_solves_every_bundled_task_token_exact(daemon) -> None:
    tasks = codex_tasks()
    assert len(tasks) == 25
    replay = ReplayPolicy(tasks, vocabulary=vocabulary("codex"))
    policy = RecordingReplay(replay)
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        check_solved_token_exact(result, by_id[result.task_id], policy.exchanges[result.task_id], replay)
