"""Harness tasks without a daemon: the task checks, and running a harness command on the host."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from corral.rollout.harness import GatewayAddress, HarnessExit, harness_environment, host_base_environment, run_on_host
from corral.rollout.tasks import TaskError, check_task, runs_on_host
from corral.v1 import rollout_pb2 as pb
from tests.conftest import alive_pids


def harness_task(**harness: object) -> pb.Task:
    task = pb.Task(task_id="h", harness=pb.TaskHarness(**harness))  # type: ignore[arg-type]
    task.prompt.messages.add(role="user", content="do it")
    return task


def test_a_harness_task_needs_a_command() -> None:
    with pytest.raises(TaskError, match="harness.command is empty"):
        check_task(harness_task())
    with pytest.raises(TaskError, match="harness.command is empty"):
        check_task(harness_task(command=[""]))
    check_task(harness_task(command=["true"]))


def test_a_harness_task_is_checked_like_any_task() -> None:
    bad_tools = harness_task(command=["true"])
    bad_tools.tools.append("teleport")
    with pytest.raises(TaskError, match="unknown tools"):
        check_task(bad_tools)
    fenced = harness_task(command=["true"])
    fenced.tool_call_format = pb.TOOL_CALL_FORMAT_FENCED_BASH
    fenced.tools.append("python")
    with pytest.raises(TaskError, match="fenced-bash"):
        check_task(fenced)


@pytest.mark.parametrize(
    ("harness", "message"),
    [
        ({"command": ["true"], "place": 7}, "unknown harness.place"),
        ({"command": ["true"], "history_policy": 9}, "unknown harness.history_policy"),
        ({"command": ["true"], "env": {"A=B": "1"}}, "unusable variable"),
        ({"command": ["true"], "workdir": "relative/dir"}, "absolute path"),
    ],
)
def test_bad_harness_fields_are_the_callers_mistake(harness: dict, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        check_task(harness_task(**harness))


def test_the_harness_runs_on_the_host_unless_it_names_the_sandbox() -> None:
    assert runs_on_host(harness_task(command=["true"]))
    assert runs_on_host(harness_task(command=["true"], place=pb.HARNESS_PLACE_HOST))
    assert not runs_on_host(harness_task(command=["true"], place=pb.HARNESS_PLACE_SANDBOX))
    plain = pb.Task(task_id="plain")
    assert not runs_on_host(plain)


async def test_a_host_harness_gets_exactly_its_environment(tmp_path: Path) -> None:
    script = "import os, json; print(json.dumps(dict(os.environ)))"
    env = {**host_base_environment(), "OPENAI_API_KEY": "k"}
    outcome = await run_on_host([sys.executable, "-c", script], env, str(tmp_path))
    assert outcome.succeeded
    seen = __import__("json").loads(outcome.output)
    assert seen.pop("OPENAI_API_KEY") == "k"
    assert set(seen) - {"LC_CTYPE"} <= {"PATH", "HOME", "LANG"}


async def test_a_failing_harness_leaves_the_end_of_its_output(tmp_path: Path) -> None:
    script = "import sys; print('x' * 200000, file=sys.stderr); print('the last words', file=sys.stderr); sys.exit(3)"
    outcome = await run_on_host([sys.executable, "-c", script], host_base_environment(), str(tmp_path))
    assert (outcome.started, outcome.exit_code) == (True, 3)
    assert outcome.output.endswith("the last words") and len(outcome.output) <= 64 << 10
    assert outcome.describe().startswith("the harness exited 3: ")


async def test_a_command_that_does_not_exist_could_not_start(tmp_path: Path) -> None:
    outcome = await run_on_host(["/nonexistent/harness"], {}, str(tmp_path))
    assert outcome == HarnessExit(False, -1, outcome.output) and "No such file" in outcome.output
    assert outcome.describe().startswith("the harness could not be started")


async def wait_gone(pids: set[int], timeout: float = 2.0) -> None:
    """Until none of `pids` runs (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + timeout
    while alive_pids(pids):
        assert time.monotonic() < deadline, f"{alive_pids(pids)} still running"
        await asyncio.sleep(0.02)


async def test_cancelling_kills_the_whole_process_group(tmp_path: Path) -> None:
    # The harness starts a child that ignores SIGTERM and writes both pids, then waits forever.
    pids = tmp_path / "pids"
    script = (
        "import os, signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        "time.sleep(600)\n"
    )
    run = asyncio.ensure_future(run_on_host([sys.executable, "-c", script], host_base_environment(), str(tmp_path)))
    deadline = time.monotonic() + 10
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert time.monotonic() < deadline, "the harness did not start"
        await asyncio.sleep(0.05)
    harness_pid, child_pid = map(int, pids.read_text().split())
    started = time.monotonic()
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    # SIGTERM took the harness; the child that ignores it got SIGKILL after the grace.
    assert time.monotonic() - started < 5
    await wait_gone({harness_pid, child_pid})


async def test_what_a_harness_leaves_running_ends_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '600'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
    )
    outcome = await asyncio.wait_for(
        run_on_host([sys.executable, "-c", script], host_base_environment(), str(tmp_path)), 10
    )
    assert outcome.succeeded
    await wait_gone({int(pid_file.read_text())})


@pytest.mark.parametrize("listen", ["127.0.0.1", "127.0.0.1:x", ":80", "127.0.0.1:70000"])
def test_a_bad_gateway_listen_address_is_a_config_error(tmp_path: Path, listen: str) -> None:
    from corral.daemon.config import ConfigError, load_config

    path = tmp_path / "corral.toml"
    path.write_text(f'[rollout]\ngateway_listen = "{listen}"\n')
    with pytest.raises(ConfigError, match="rollout.gateway_listen"):
        load_config(path)


def test_the_gateway_listens_on_loopback_and_host_harnesses_are_off_by_default() -> None:
    from corral.daemon.config import RolloutConfig, gateway_address

    config = RolloutConfig()
    assert gateway_address(config.gateway_listen) == ("127.0.0.1", 0)
    assert gateway_address("[::1]:8000") == ("::1", 8000)
    assert config.allow_host_harness is False


def test_every_api_s_clients_find_the_gateway_session_under_their_own_variables():
    env = harness_environment(
        GatewayAddress("http://127.0.0.1:4000/v1", "key-1", "corral"),
        rollout_id="r",
        sandbox_id="s",
        daemon_address="unix:///run/corral.sock",
        task_prompt="fix it",
        workdir="/workspace",
        task_env={"ANTHROPIC_API_KEY": "the task's own"},
    )
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:4000/v1" and env["OPENAI_API_KEY"] == "key-1"
    assert env["ANTHROPIC_BASE_URL"] == env["GOOGLE_GEMINI_BASE_URL"] == env["CORRAL_GATEWAY_URL"]
    assert env["CORRAL_GATEWAY_URL"] == "http://127.0.0.1:4000"
    assert env["GEMINI_API_KEY"] == "key-1"
    assert env["ANTHROPIC_API_KEY"] == "the task's own"  # the task's env wins
