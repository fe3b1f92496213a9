"""What the coding-CLI integration tests (test_coding_cli_*.py) share: a local daemon whose
sandboxes see the CLIs' npm prefix read-only, the bundled repair tasks made harness tasks of one
CLI, the replay policy recording what the engine received and answered per task, running tasks
through the rollout service a few CLIs at a time, and the token-exactness check.

Which bundled tasks a CLI runs: `make test` gives each CLI its own fifth of the 25 tasks (the CLIs
together run every task once; every CLI's vocabulary answers every task in the unit tests), so
that five CLIs cost about one CLI's full run. `CORRAL_CODING_CLI_TASKS=all` runs every task
through every CLI (what the closing table of issue 30 reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

from corral.rollout.coding_clis import coding_cli, with_coding_cli
from corral.rollout.coding_clis import names as cli_names
from corral.rollout.reference.policies import GenerateParams, PolicyOutput
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import ReferenceServer, load_tasks_jsonl
from corral.rollout.reference.vocabularies import vocabulary
from corral.sdk import AsyncClient, RolloutResult
from corral.v1 import rollout_pb2 as pb
from tests.conftest import CODING_CLIS_PREFIX, DaemonProcess, require_backend, shared_daemon_config

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
WORKDIR = "/workspace"  # the sandboxes' workdir (the daemon's default), where the CLIs run
# The CLIs' system prompts and tool schemas are 30,000-76,000 bytes (Qwen Code's the most):
# byte-tokenizer ids.
MAX_TOTAL_TOKENS = 1 << 18
# CLIs at once (each a node process or a native binary taking about a second of CPU to start).
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


def replay_for(cli: str, tasks: Sequence[pb.Task]) -> RecordingReplay:
    """The replay policy answering `tasks` in `cli`'s tools."""
    return RecordingReplay(ReplayPolicy(tasks, vocabulary=vocabulary(coding_cli(cli).vocabulary), workdir=WORKDIR))


def cli_daemon(root: Path) -> Iterator[DaemonProcess]:
    """A local daemon (bubblewrap) whose `host` sandboxes show the CLIs' prefix read-only; a
    generator for a module-scoped fixture."""
    require_backend("local")
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


def bundled_tasks(cli: str) -> list[pb.Task]:
    """The bundled repair tasks this run gives `cli` (the module docstring says which)."""
    tasks = load_tasks_jsonl(REPAIR_TASKS)
    if os.environ.get("CORRAL_CODING_CLI_TASKS") == "all":
        return tasks
    every = cli_names()
    return tasks[every.index(cli) :: len(every)]


def cli_tasks(cli: str, tasks: Sequence[pb.Task] | None = None, **limits: int) -> list[pb.Task]:
    """`tasks` (default: bundled_tasks(cli)) as harness tasks run by `cli`, with room for its
    prompt (and `limits` over the tasks' own)."""
    harnessed = []
    for task in bundled_tasks(cli) if tasks is None else tasks:
        task = with_coding_cli(task, cli, CODING_CLIS_PREFIX)
        task.limits.max_total_tokens = MAX_TOTAL_TOKENS
        for name, value in limits.items():
            setattr(task.limits, name, value)
        harnessed.append(task)
    return harnessed


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


async def run_tasks(client: AsyncClient, tasks: Sequence[pb.Task]) -> list[RolloutResult]:
    """Every task through the rollout service, IN_FLIGHT at a time; results in completion order."""
    slots = asyncio.Semaphore(IN_FLIGHT)

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
    client: AsyncClient, tasks: Sequence[pb.Task], policy: RecordingReplay, *, port: int = 0
) -> list[RolloutResult]:
    async with serving(client, policy, port=port):
        return await run_tasks(client, tasks)


def check_token_exact(result: RolloutResult, task: pb.Task, exchanges: Exchanges) -> None:
    """Solved (reward 1.0), one call per reference call (the submit being the CLI's final reply),
    and token-exact against what the engine received and answered: prompt + response is its last
    prompt plus its output, every earlier call at its place, mask 1 exactly on generated ids; one
    sample, every call after the first a prefix hit, nothing spliced, split or discarded."""
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    assert len(exchanges) == len(task.reference_solution), result.task_id
    assert result.turns[-1].tool_calls == [], result.task_id
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


async def solve_all_token_exact(daemon: DaemonProcess, cli: str, tasks: list[pb.Task]) -> dict[str, list[list[str]]]:
    """Runs `tasks` by `cli`, checks each with check_token_exact, and returns per task the tools
    each turn called."""
    policy = replay_for(cli, tasks)
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        check_token_exact(result, by_id[result.task_id], policy.exchanges[result.task_id])
    return {r.task_id: [[call.name for call in turn.tool_calls] for turn in r.turns] for r in results}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


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
