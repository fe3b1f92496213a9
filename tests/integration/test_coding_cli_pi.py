"""Pi solves every bundled repair task inside its sandbox (network off), through the rollout service
and the gateway's chat completions, token-exact (tests/integration/coding_cli_support.py; `make test` runs a fifth of the tasks).

Each reference edit is answered with Pi's `edit` {path, edits: [{oldText, newText}]}, the test run
with `bash`, and the submit with a plain reply, which ends its `-p` run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from corral.rollout.coding_clis import with_coding_cli
from corral.sdk import AsyncClient
from tests.conftest import CODING_CLIS_PREFIX, DaemonProcess, require_coding_cli
from tests.integration.coding_cli_support import (
    check_token_exact,
    cli_daemon,
    cli_tasks,
    free_port,
    reachability_task,
    replay_for,
    solve_all_token_exact,
)
from tests.integration.replay_rollouts import (
    run_all,
)

require_coding_cli("pi")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    yield from cli_daemon(tmp_path_factory.mktemp("daemon-pi"))


@pytest.mark.timeout(1800)
async def test_pi_solves_the_bundled_tasks_token_exact(daemon) -> None:
    tasks = cli_tasks("pi")
    tools = await solve_all_token_exact(daemon, "pi", tasks)
    for task in tasks:
        edits = sum(1 for call in task.reference_solution if call.name == "editor")
        assert tools[task.task_id] == [["edit"]] * edits + [["bash"], []]


async def test_pi_inside_the_sandbox_reaches_the_gateway_and_nothing_else(daemon) -> None:
    # Pi runs the reachability program with its bash tool: the reference LLM server the gateway
    # forwards to (on the node's loopback), a public address and DNS all fail, and Pi still ends
    # its task through the gateway.
    port = free_port()
    task = with_coding_cli(
        reachability_task("pi-reachability", f"http://127.0.0.1:{port}/health"), "pi", CODING_CLIS_PREFIX
    )
    policy = replay_for("pi", [task])
    async with AsyncClient(daemon.address) as client:
        (result,) = await run_all(client, [task], policy, port=port)
    exchanges = policy.exchanges[task.task_id]
    assert len(exchanges) == 2
    check_token_exact(result, task, exchanges)
    # What the program printed came back to the model as the bash tool's result.
    final_prompt = policy.prompt_text(task.task_id)
    for target in ("llm-server", "public-ip", "dns"):
        assert f"{target}: failed (" in final_prompt
