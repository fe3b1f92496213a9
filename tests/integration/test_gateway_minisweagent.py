"""An unmodified agent harness trains on corral: mini-swe-agent (its real DefaultAgent and
LitellmModel, `python -m corral.integrations.minisweagent_harness`) runs as the RUN stage of harness
tasks, talking OpenAI tool calls to the daemon's LLM gateway, which forwards token ids to the
built-in reference server. The server plays each bundled repair task's reference solution in
mini's own action format (the replay policy with `submit_command`: every call a `bash` call, the
last one mini's submit command); the gateway parses its HERMES markup into OpenAI tool_calls.

Checked per task: reward 1.0, and the trajectory is token-exact against what the engine itself
received and generated (a recording wrapper around the replay policy): prompt_ids + response_ids
are the last prompt it received plus its output, every earlier call's prompt and output lie at
their places in that sequence, response_mask is 1 exactly on the generated ids; the gateway's
counters say one call per turn, each call's prompt the recorded ids plus the new messages (no
splice, no split).

The entry point's own contract (its exit status per ending, the variables it needs) is checked
first, against a real gateway in this process whose generations are scripted.

Two placements: the harness on the node, acting in the rollout's sandbox through
CorralEnvironment attached to it; and the harness inside the sandbox with mini's own
LocalEnvironment. For the latter the sandbox needs Python with mini and litellm: the daemon's
`local.host_paths` shows this test's interpreter, its venv and the repository read-only in every
`host` sandbox (the tasks run in such sandboxes), so the very interpreter running this test runs
the harness inside.
"""

from __future__ import annotations

import os

from tests.conftest import require_harness

require_harness("minisweagent", "minisweagent", "minisweagent")

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from corral.integrations import minisweagent_harness  # noqa: E402
from corral.rollout.gateway import Gateway, SessionSettings  # noqa: E402
from corral.rollout.reference.replay import ReplayPolicy  # noqa: E402
from corral.rollout.reference.server import load_tasks_jsonl  # noqa: E402
from corral.rollout.tokenizer import IM_END, ByteChatTokenizer  # noqa: E402
from corral.rollout.types import Generation, SamplingOptions  # noqa: E402
from corral.sdk import AsyncClient, RolloutResult  # noqa: E402
from corral.v1 import rollout_pb2 as pb  # noqa: E402
from tests.conftest import DaemonProcess, require_backend, shared_daemon_config  # noqa: E402
from tests.integration.replay_rollouts import RecordingReplay, check_one_token_exact_sample, run_all  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REPAIR_TASKS = REPO / "examples" / "tasks" / "repair.jsonl"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
HARNESS = [sys.executable, "-m", "corral.integrations.minisweagent_harness"]
# mini keeps a config directory (and reads a .env there): its own per run, not the user's.
HARNESS_ENV = {"MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mini-swe-agent-config"}
# Harness processes at once: each imports litellm (seconds of CPU on a small machine).
IN_FLIGHT = 6


# The entry point on its own: a real gateway, scripted generations.


def bash_call(command: str) -> str:
    return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}})}</tool_call>"


@contextlib.contextmanager
def scripted_gateway(replies: list[str], max_calls: int) -> Iterator[tuple[str, str]]:
    """A gateway on its own event loop in a thread whose engine answers `replies` in turn; yields
    (base URL, key) of one session allowed `max_calls` calls."""
    tokenizer = ByteChatTokenizer()
    end = tokenizer.special_ids[IM_END]
    pending = list(replies)

    async def generate(prompt_ids: list[int], sampling: SamplingOptions, rollout_id: str) -> Generation:
        ids = tokenizer.encode(pending.pop(0)) + [end]
        return Generation(ids, [0.0] * len(ids), "stop")

    gateway = Gateway(generate, tokenizer)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        url = asyncio.run_coroutine_threadsafe(gateway.listen_tcp(), loop).result(30)
        settings = SessionSettings(
            sampling=SamplingOptions(max_new_tokens=512),
            max_new_tokens_per_turn=512,
            max_total_tokens=1 << 16,
            max_calls=max_calls,
        )
        yield url, gateway.open_session("scripted", settings).key
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


@pytest.fixture
def harness_env(monkeypatch, tmp_path) -> Iterator[None]:
    monkeypatch.setenv("CORRAL_MODEL", "policy")
    monkeypatch.setenv("CORRAL_TASK_PROMPT", "Create the file done.txt.")
    monkeypatch.setenv("CORRAL_WORKDIR", str(tmp_path))
    monkeypatch.setenv("MSWEA_GLOBAL_CONFIG_DIR", str(tmp_path / "mini-config"))
    yield


def run_harness(monkeypatch, url: str, key: str, *argv: str) -> int:
    monkeypatch.setenv("OPENAI_BASE_URL", url)
    monkeypatch.setenv("OPENAI_API_KEY", key)
    return minisweagent_harness.main(["--environment", "local", *argv])


def test_harness_exits_0_when_mini_submits(harness_env, monkeypatch, tmp_path) -> None:
    with scripted_gateway([bash_call("touch done.txt"), bash_call(SUBMIT)], max_calls=5) as (url, key):
        assert run_harness(monkeypatch, url, key, "-o", str(tmp_path / "trajectory.json")) == 0
    assert (tmp_path / "done.txt").exists()
    saved = json.loads((tmp_path / "trajectory.json").read_text())
    assert saved["info"]["exit_status"] == "Submitted"
    assert saved["messages"][1]["content"].startswith("Please solve this issue: Create the file done.txt.")


def test_harness_exits_0_when_the_gateway_stops_it_at_max_turns(harness_env, monkeypatch, tmp_path, capsys) -> None:
    with scripted_gateway([bash_call("touch done.txt")], max_calls=1) as (url, key):
        assert run_harness(monkeypatch, url, key) == 0
    assert (tmp_path / "done.txt").exists()
    assert "stopped by the gateway" in capsys.readouterr().err


def test_harness_exits_1_when_the_gateway_refuses_its_key(harness_env, monkeypatch, capsys) -> None:
    with scripted_gateway([], max_calls=1) as (url, _):
        assert run_harness(monkeypatch, url, "not-a-key") == 1
    assert "the model call failed" in capsys.readouterr().err


def test_harness_exits_2_without_the_gateway_s_variables(harness_env, monkeypatch, capsys) -> None:
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("CORRAL_SANDBOX_ID", raising=False)
    monkeypatch.delenv("CORRAL_ADDRESS", raising=False)
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    assert minisweagent_harness.main([]) == 2
    assert "OPENAI_BASE_URL, CORRAL_ADDRESS, CORRAL_SANDBOX_ID" in capsys.readouterr().err


# Every bundled task through the daemon.


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    """A local daemon that runs harness tasks on the node too, and shows every `host` sandbox this
    test's interpreter, venv and repository (read-only) for the harness inside the sandbox."""
    require_backend("local")
    root = tmp_path_factory.mktemp("daemon-gateway-mini")
    shown = sorted({os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, REPO)})
    config = root / "corral.toml"
    config.write_text(
        shared_daemon_config(
            "[rollout]\nllm_unavailable_wait_s = 2\nallow_host_harness = true\n"
            f"[local]\nhost_paths = {json.dumps(shown)}\n"
        )
    )
    proc = DaemonProcess(root, "--config", str(config)).start()
    yield proc
    proc.stop()


def harness_tasks(place: pb.HarnessPlace, *argv: str) -> list[pb.Task]:
    tasks = load_tasks_jsonl(REPAIR_TASKS)
    for task in tasks:
        task.harness.command.extend([*HARNESS, *argv])
        task.harness.env.update(HARNESS_ENV)
        task.harness.place = place
    return tasks


def check_solved_token_exact(
    result: RolloutResult, task: pb.Task, exchanges: list[tuple[list[int], list[int]]]
) -> None:
    assert (result.status, result.reward) == ("completed", 1.0), (result.task_id, result.error, result.eval_output)
    # mini made one call per reference call: the last one is its submit command.
    assert len(exchanges) == len(task.reference_solution), result.task_id
    assert [call.name for turn in result.turns for call in turn.tool_calls] == ["bash"] * len(exchanges)
    assert json.loads(result.turns[-1].tool_calls[0].arguments_json) == {"command": SUBMIT}
    # Token-exact, one call per turn, every later call's prompt the recorded ids plus mini's new messages.
    check_one_token_exact_sample(result, exchanges)


async def solve_all_token_exact(daemon: DaemonProcess, tasks: list[pb.Task]) -> None:
    policy = RecordingReplay(ReplayPolicy(tasks, submit_command=SUBMIT))
    async with AsyncClient(daemon.address) as client:
        results = await run_all(client, tasks, policy, in_flight=IN_FLIGHT)
    by_id = {task.task_id: task for task in tasks}
    assert sorted(r.task_id for r in results) == sorted(by_id)
    for result in results:
        check_solved_token_exact(result, by_id[result.task_id], policy.exchanges[result.task_id])


# The tasks mini itself solves on the node: both shapes of the bundled solutions (one edit and two)
# and non-ASCII text through litellm and the gateway. Every bundled task's replay as mini's bash
# calls is checked in tests/unit/test_replay_bash_only.py, and every one through the daemon in
# tests/integration/test_run_command.py: mini's real path needs not run all 25 (96 s).
ON_THE_NODE = ("accounts-super-init", "bitflags-clear-toggle", "nickname-utf8-truncate", "semver-strict-parse")


async def test_mini_swe_agent_on_the_node_solves_bundled_tasks_token_exact(daemon) -> None:
    tasks = [task for task in harness_tasks(pb.HARNESS_PLACE_HOST) if task.task_id in ON_THE_NODE]
    assert len(tasks) == len(ON_THE_NODE)
    await solve_all_token_exact(daemon, tasks)


async def test_mini_swe_agent_inside_the_sandbox_solves_tasks_token_exact(daemon) -> None:
    await solve_all_token_exact(daemon, harness_tasks(pb.HARNESS_PLACE_SANDBOX, "--environment", "local")[:2])
