"""Qwen Code solves bundled repair tasks (its fifth of them; all 25 with CORRAL_CODING_CLI_TASKS=all)
inside its sandbox (network off), through the rollout service and the gateway's chat completions,
token-exact (tests/integration/coding_cli_support.py).

Each reference edit is answered with `read_file` then `edit` in one reply (its edit refuses a file
not read in the session), the test run with `run_shell_command`, and the submit with a plain
reply, which ends its headless run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import DaemonProcess, require_coding_cli
from tests.integration.coding_cli_support import cli_daemon, cli_tasks, solve_all_token_exact

require_coding_cli("qwen")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    yield from cli_daemon(tmp_path_factory.mktemp("daemon-qwen"))


@pytest.mark.timeout(1800)
async def test_qwen_code_solves_the_bundled_tasks_token_exact(daemon) -> None:
    tasks = cli_tasks("qwen")
    tools = await solve_all_token_exact(daemon, "qwen", tasks)
    for task in tasks:
        edits = sum(1 for call in task.reference_solution if call.name == "editor")
        assert tools[task.task_id] == [["read_file", "edit"]] * edits + [["run_shell_command"], []]
