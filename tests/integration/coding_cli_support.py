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

import json
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

from corral.rollout.coding_clis import coding_cli, with_coding_cli
from corral.rollout.coding_clis import names as cli_names
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import load_tasks_jsonl
from corral.rollout.reference.vocabularies import vocabulary
from corral.sdk import AsyncClient, RolloutResult
from corral.v1 import rollout_pb2 as pb
from tests.conftest import CODING_CLIS_PREFIX, DaemonProcess, require_backend, shared_daemon_config
from tests.integration.replay_rollouts import (
    Exchanges,
    RecordingReplay,
    check_one_token_exact_sample,
    run_all,
)

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
WORKDIR = "/workspace"  # the sandboxes' workdir (the daemon's default), where the CLIs run
# The CLIs' system prompts and tool schemas are 30,000-76,000 bytes (Qwen Code's the most):
# byte-tokenizer ids.
MAX_TOTAL_TOKENS = 1 << 18


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


def check_token_exact(result: RolloutResult, task: pb.Task, exchanges: Exchanges) -> None:
    """Solved (reward 1.0), one call per reference call (the submit being the CLI's final reply),
    and token-exact against what the engine received and answered: prompt + response is its last
    prompt plus its output, every earlier call at its place, mask 1 exactly on generated ids; one
    sample, every call after the first a prefix hit, nothing spliced, split or discarded."""
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    assert len(exchanges) == len(task.reference_solution), result.task_id
    assert result.turns[-1].tool_calls == [], result.task_id
    check_one_token_exact_sample(result, exchanges)


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
