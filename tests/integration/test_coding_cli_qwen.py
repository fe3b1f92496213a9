"""Qwen Code solves bundled repair tasks (four; all 25 with CORRAL_CODING_CLI_TASKS=all) inside its
sandbox (network off), through the rollout service and the gateway's chat completions, token-exact
(tests/integration/coding_cli_runs.py).

Each reference edit is answered with `read_file` then `edit` in one reply (its edit refuses a file
not read in the session), the test run with `run_shell_command`, and the submit with a plain
reply, which ends its headless run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import DaemonProcess, require_coding_cli
from tests.integration.coding_cli_runs import TASKS_TIMEOUT_S, bundled_tasks, daemon_fixture, solve_all_token_exact

require_coding_cli("qwen")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    yield from daemon_fixture(tmp_path_factory, "qwen")


@pytest.mark.timeout(TASKS_TIMEOUT_S)
async def test_qwen_code_solves_the_bundled_tasks_token_exact(daemon) -> None:
    tasks = bundled_tasks("qwen", every=False)
    tools = await solve_all_token_exact(daemon, "qwen", tasks)
    for task in tasks:
        edits = sum(1 for call in task.reference_solution if call.name == "editor")
        assert tools[task.task_id] == [["read_file", "edit"]] * edits + [["run_shell_command"], []]
