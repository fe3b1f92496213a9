"""Gemini CLI (@google/gemini-cli, the real npm package) solves every bundled repair task as a
harness task inside a local sandbox with its network off, through the rollout service: it speaks
Gemini's streamGenerateContent to the daemon's gateway on the sandbox's loopback, which forwards
token ids to the reference server playing each task's reference solution in the CLI's own tools
(the replay policy with the `gemini` vocabulary: `replace`, `run_shell_command`, then a final
reply without tool calls).

`make test` runs a fifth of them (coding_cli_support.py). Checked per task: reward 1.0; the trajectory is token-exact against what the engine received and
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

from tests.conftest import require_coding_cli

require_coding_cli("gemini")

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402

from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary  # noqa: E402
from corral.sdk import AsyncClient  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.conftest import DaemonProcess  # noqa: E402
from tests.integration.coding_cli_support import (  # noqa: E402
    WORKDIR,
    bundled_tasks,
    check_token_exact,
    cli_daemon,
    cli_tasks,
)
from tests.integration.replay_rollouts import (  # noqa: E402
    RecordingReplay,
    run_tasks,
    serving,
)

pytestmark = [pytest.mark.above_backend, pytest.mark.timeout(1800)]

# Exits 5 when the URL in $PROBE_URL answers: run before the CLI, it shows that the sandbox
# reaches nothing on the node but the gateway.
PROBE = (
    "import os, sys, urllib.request\n"
    "try:\n    urllib.request.urlopen(os.environ['PROBE_URL'], timeout=3)\n"
    "except OSError:\n    sys.exit(0)\n"
    "print(os.environ['PROBE_URL'], 'is reachable from the sandbox', file=sys.stderr)\nsys.exit(5)\n"
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    yield from cli_daemon(tmp_path_factory.mktemp("daemon-gemini-cli"))


def probed(task: pb.Task, probe_url: str) -> pb.Task:
    """The task with the probe run before the CLI."""
    command = list(task.harness.command)
    del task.harness.command[:]
    task.harness.command.extend(["sh", "-c", 'python3 -c "$PROBE" && exec "$@"', "probe", *command])
    task.harness.env.update({"PROBE": PROBE, "PROBE_URL": probe_url})
    return task


# The 25 tasks took 706 s (572 CPU-seconds, the daemon's sandboxes and evaluations included; the
# CLI about 3.5 of them per task) on the 2-core development machine at load average 8 to 27.
async def test_gemini_cli_in_a_sandbox_without_network_solves_the_repair_tasks_token_exact(daemon) -> None:
    policy = RecordingReplay(ReplayPolicy(bundled_tasks("gemini"), vocabulary=vocabulary("gemini"), workdir=WORKDIR))
    async with AsyncClient(daemon.address) as client, serving(client, policy) as url:
        tasks = [probed(task, url + "/health") for task in cli_tasks("gemini")]
        results = await run_tasks(client, tasks)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        task = by_id[result.task_id]
        check_token_exact(result, task, policy.exchanges[result.task_id])
        names = [call.name for turn in result.turns for call in turn.tool_calls]
        expected = [
            "run_shell_command" if call.name == "bash" else "replace"
            for call in task.reference_solution
            if call.name != "submit"
        ]
        assert names == expected, result.task_id
        assert result.messages[-1]["content"].endswith(FINAL_TEXT)
