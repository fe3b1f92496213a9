"""What the coding-CLI integration tests share (tests/integration/test_coding_cli_*.py): a local
daemon (bubblewrap) whose `host` sandboxes see the CLIs' npm prefix read-only, the bundled repair
tasks run by one CLI inside their sandboxes through the rollout service against the replay policy
in that CLI's tool vocabulary, and the checks that each run is solved and token-exact.

The gateway session sees what the CLI really sends: its own system prompt and tools, its tool
results, and whatever it calls besides; the replay policy answers each reference call in the
CLI's own tools (rollout/reference/vocabularies) and the final submit with a plain reply.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

from corral.rollout.coding_clis import coding_cli, with_coding_cli
from corral.rollout.reference.policies import GenerateParams, PolicyOutput
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer, load_tasks_jsonl
from corral.rollout.reference.vocabularies import vocabulary
from corral.sdk import AsyncClient, RolloutResult
from corral.v1 import rollout_pb2 as pb
from tests.conftest import CODING_CLIS_PREFIX, DaemonProcess, require_backend, shared_daemon_config

REPO = Path(__file__).resolve().parents[2]
REPAIR_TASKS = REPO / "examples" / "tasks" / "repair.jsonl"
# The sandboxes' working directory (the daemon's default): the CLIs run there.
WORKDIR = "/workspace"
# A sample's token budget: the CLIs' own system prompts and tool schemas are tens of kilobytes,
# and the replay policy's byte tokenizer makes every byte a token (Qwen Code's first prompt is
# about 76,000 bytes).
MAX_TOTAL_TOKENS = 1 << 18
# The bundled tasks a CLI's test runs: all 25 where a CLI is light (Pi: about 30 s in all), else
# these four, both shapes of the bundled solutions (one edit and two) and non-ASCII text (Qwen Code
# spends about 8 s of CPU a task: two Node processes and a 76 KB prompt per call; all 25 took 317 s
# on 2 busy cores); CORRAL_CODING_CLI_TASKS=all runs all 25 for every CLI.
ALL_TASKS = os.environ.get("CORRAL_CODING_CLI_TASKS") == "all"
REPRESENTATIVE_TASKS = ("accounts-super-init", "bitflags-clear-toggle", "nickname-utf8-truncate", "semver-strict-parse")
# The timeout of a test that runs them.
TASKS_TIMEOUT_S = 2400 if ALL_TASKS else 600
# Rollouts at once: each CLI is a Node process of a few hundred MB starting in a few seconds.
IN_FLIGHT = 4


def start_cli_daemon(root: Path) -> DaemonProcess:
    """A local daemon on bubblewrap whose `host` sandboxes show the CLIs' prefix read-only at its
    own path (local.host_paths), as a node running coding-CLI tasks is configured."""
    require_backend("local")
    config = root / "corral.toml"
    shown = json.dumps([os.path.realpath(CODING_CLIS_PREFIX)])
    config.write_text(shared_daemon_config(f'[local]\nisolation = "bwrap"\nhost_paths = {shown}\n'))
    return DaemonProcess(root, "--config", str(config)).start()


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

    def prompt_text(self, task_id: str, index: int = -1) -> str:
        return self.replay.tokenizer.decode(self.exchanges[task_id][index][0])


def bundled_tasks(cli: str, *, every: bool) -> list[pb.Task]:
    """The bundled repair tasks (all of them with `every`, else REPRESENTATIVE_TASKS unless
    ALL_TASKS), run by `cli` inside its sandbox."""
    tasks = [
        with_coding_cli(task, cli, CODING_CLIS_PREFIX)
        for task in load_tasks_jsonl(REPAIR_TASKS)
        if every or ALL_TASKS or task.task_id in REPRESENTATIVE_TASKS
    ]
    for task in tasks:
        task.limits.max_total_tokens = MAX_TOTAL_TOKENS
    return tasks


def replay_for(cli: str, tasks: Sequence[pb.Task]) -> RecordingReplay:
    return RecordingReplay(ReplayPolicy(tasks, vocabulary=vocabulary(coding_cli(cli).vocabulary), workdir=WORKDIR))


async def run_all(
    client: AsyncClient, tasks: Sequence[pb.Task], policy: RecordingReplay, *, port: int = 0
) -> list[RolloutResult]:
    """Every task through the daemon, IN_FLIGHT at a time, against a reference server playing
    `policy` (on `port` of the node's loopback; 0: any free one)."""
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def feed() -> AsyncIterator[pb.Task]:
        for task in tasks:
            await slots.acquire()
            yield task

    server = ReferenceServer(policy, port=port)
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


def check_solved_token_exact(result: RolloutResult, exchanges: list[tuple[list[int], list[int]]]) -> None:
    """Reward 1.0, one sample that is what the engine last received plus what it generated, every
    call at its place in it, the mask 1 exactly on generated ids; one call per turn, each extending
    the one before (no splice, no split)."""
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    full = result.prompt_ids + result.response_ids
    last_prompt, last_output = exchanges[-1]
    assert full == last_prompt + last_output, result.task_id
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
    assert (result.gateway.calls, result.gateway.prefix_hits) == (len(exchanges), len(exchanges) - 1), result.task_id
    assert (result.gateway.splices, result.gateway.splits, result.gateway.discarded) == (0, 0, 0), result.task_id
    assert result.extra_samples == []


async def solve_all_token_exact(daemon: DaemonProcess, cli: str, tasks: list[pb.Task]) -> dict[str, list[list[str]]]:
    """Runs `tasks` by `cli`, checks each solved and token-exact with one call per reference call
    (the last one the CLI's final reply), and returns per task the tools each turn called."""
    policy = replay_for(cli, tasks)
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    tools = {}
    for result in results:
        exchanges = policy.exchanges[result.task_id]
        assert len(exchanges) == len(by_id[result.task_id].reference_solution), (
            result.task_id,
            result.status,
            result.reward,
            result.error,
            result.eval_output,
            len(exchanges),
            result.gateway,
        )
        check_solved_token_exact(result, exchanges)
        tools[result.task_id] = [[call.name for call in turn.tool_calls] for turn in result.turns]
    return tools


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def daemon_fixture(tmp_path_factory, name: str) -> Iterator[DaemonProcess]:
    proc = start_cli_daemon(tmp_path_factory.mktemp(f"daemon-{name}"))
    yield proc
    proc.stop()


# A program for a CLI's shell tool: it tries to reach what a sandbox must not (the LLM server on the
# node, a public address, a DNS server) and prints how each attempt ended; it exits 1 if any
# succeeded. Standard library only: the sandbox's python3 runs it.
REACHABILITY = """\
import socket, sys, urllib.request
def attempt(name, reach):
    try:
        reach()
    except OSError as error:
        return f"{name}: failed ({type(error).__name__})"
    return f"{name}: REACHED"
lines = [
    attempt("llm-server", lambda: urllib.request.urlopen(sys.argv[1], timeout=5)),
    attempt("public-ip", lambda: socket.create_connection(("1.1.1.1", 443), timeout=5)),
    attempt("dns", lambda: socket.getaddrinfo("registry.npmjs.org", 443)),
]
print("\\n".join(lines))
sys.exit(any(line.endswith("REACHED") for line in lines))
"""


def reachability_task(task_id: str, llm_server_url: str) -> pb.Task:
    """A task whose solution runs REACHABILITY with the CLI's shell tool and then ends; its
    evaluation passes when the program found nothing reachable (its output saved by the solution)."""
    task = pb.Task(task_id=task_id)
    task.prompt.messages.add(role="user", content=f"[{task_id}] Check what this sandbox can reach.")
    task.setup.files.add(path="reachability.py", content=REACHABILITY.encode())
    command = (
        f"python3 reachability.py {llm_server_url} > reachability.txt; status=$?; cat reachability.txt; exit $status"
    )
    task.reference_solution.add(name="bash", arguments_json=json.dumps({"command": command}))
    task.reference_solution.add(name="submit", arguments_json="{}")
    task.evaluation.commands.append("test -s reachability.txt && ! grep -q REACHED reachability.txt")
    task.evaluation.exit_status.SetInParent()
    task.limits.max_total_tokens = MAX_TOTAL_TOKENS
    return task
