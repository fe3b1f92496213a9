"""The replay policy answering as a harness whose only tool is bash (mini-swe-agent's shape):
editor calls become a bash command doing what corral's editor does, the submit call becomes the
harness's submit command, and a harness's own prompt around the task text is still recognised,
turn by turn."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from corral.rollout.prompt import fill_prompt_fields
from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.policies import GenerateParams, PolicyError
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import load_tasks_jsonl, make_policy
from corral.rollout.tasks import DEFAULT_MAX_NEW_TOKENS
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, parse_tool_calls, render_tool_calls
from corral.rollout.types import ToolCall
from corral.v1 import rollout_pb2 as pb

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
TOK = ByteChatTokenizer()


def run_call(call: ToolCall, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert call.name == "bash"
    return subprocess.run(["bash", "-c", call.arguments["command"]], cwd=cwd, capture_output=True, text=True)


def editor(**arguments: object) -> ToolCall:
    return as_bash_call(ToolCall("editor", dict(arguments)), SUBMIT)


def test_str_replace_as_bash_replaces_exactly_one_occurrence(tmp_path: Path) -> None:
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b  # 'quoted' \"too\"\n")
    done = run_call(editor(command="str_replace", path="calc.py", old_str="a - b", new_str="a + b"), tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "calc.py").read_text() == "def add(a, b):\n    return a + b  # 'quoted' \"too\"\n"


@pytest.mark.parametrize(("text", "count"), [("x = 1\n", 0), ("y y\n", 2)])
def test_str_replace_as_bash_refuses_a_missing_or_repeated_old_str(tmp_path: Path, text: str, count: int) -> None:
    (tmp_path / "f.py").write_text(text)
    done = run_call(editor(command="str_replace", path="f.py", old_str="y", new_str="z"), tmp_path)
    assert done.returncode == 1
    assert f"old_str occurs {count} times in f.py" in done.stderr
    assert (tmp_path / "f.py").read_text() == text  # untouched


def test_create_insert_and_view_as_bash(tmp_path: Path) -> None:
    assert run_call(editor(command="create", path="n.txt", file_text="one\nthree"), tmp_path).returncode == 0
    assert run_call(editor(command="insert", path="n.txt", insert_line=1, new_str="two"), tmp_path).returncode == 0
    assert run_call(editor(command="insert", path="n.txt", insert_line=0, new_str="zero\n"), tmp_path).returncode == 0
    assert (tmp_path / "n.txt").read_text() == "zero\none\ntwo\nthree"
    viewed = run_call(editor(command="view", path="n.txt", view_range=[2, 3]), tmp_path)
    assert viewed.stdout == "     2\tone\n     3\ttwo\n"
    outside = run_call(editor(command="insert", path="n.txt", insert_line=9, new_str="x"), tmp_path)
    assert outside.returncode == 1 and "outside the file (0 to 4)" in outside.stderr


def test_bash_and_submit_calls_and_a_tool_without_a_bash_form() -> None:
    assert as_bash_call(ToolCall("bash", {"command": "ls"}), SUBMIT) == ToolCall("bash", {"command": "ls"})
    assert as_bash_call(ToolCall("submit", {}), SUBMIT) == ToolCall("bash", {"command": SUBMIT})
    with pytest.raises(ValueError, match="cannot replay a 'python' call"):
        as_bash_call(ToolCall("python", {"code": "x = 1"}), SUBMIT)


def chatml(messages: list[dict[str, str]]) -> list[int]:
    return TOK.encode_prompt(messages)


async def answer(policy: ReplayPolicy, messages: list[dict[str, str]]) -> ToolCall:
    output = await policy.generate(chatml(messages), GenerateParams(max_new_tokens=4096))
    assert output.finish_reason == "stop"
    calls = parse_tool_calls(TOK.decode(output.output_ids[:-1]), ToolCallFormat.HERMES)
    assert len(calls) == 1
    return calls[0]


async def test_every_bundled_task_replays_as_bash_calls_inside_a_harness_s_own_prompt() -> None:
    """A mini-like conversation: its own system message, the task text inside its instance
    template, then assistant tool calls and tool results. Turn k answers reference call k in its
    bash form; past the end, the submit command."""
    tasks = load_tasks_jsonl(REPAIR_TASKS)
    policy = ReplayPolicy(tasks, submit_command=SUBMIT)
    for task in tasks:
        user = fill_prompt_fields(next(m.content for m in task.prompt.messages if m.role == "user"), task.prompt.fields)
        messages = [
            {"role": "system", "content": "You are a helpful assistant that can interact with a computer."},
            {"role": "user", "content": f"Please solve this issue: {user}\n\nYou can execute bash commands."},
        ]
        expected = [
            as_bash_call(ToolCall(c.name, json.loads(c.arguments_json or "{}")), SUBMIT)
            for c in task.reference_solution
        ]
        for want in [*expected, ToolCall("bash", {"command": SUBMIT})]:
            got = await answer(policy, messages)
            assert got == want, task.task_id
            messages += [
                {
                    "role": "assistant",
                    "content": f"<tool_call>{json.dumps({'name': 'bash', 'arguments': got.arguments})}</tool_call>",
                },
                {"role": "tool", "content": '{"returncode": 0, "output": ""}'},
            ]
        assert expected[-1] == ToolCall("bash", {"command": SUBMIT})  # the bundled solutions end by submitting


def test_the_submit_command_is_an_option_of_the_replay_policy_only() -> None:
    task = pb.Task(task_id="t")
    task.prompt.messages.add(role="user", content="do it")
    with pytest.raises(ValueError, match="non-empty"):
        ReplayPolicy([task], submit_command=" ")
    with pytest.raises(ValueError, match="options of the replay policy"):
        make_policy("tiny", submit_command=SUBMIT)
    assert make_policy("replay", tasks=str(REPAIR_TASKS), submit_command=SUBMIT).submit_command == SUBMIT  # type: ignore[attr-defined]


async def test_a_task_whose_solution_has_no_bash_form_is_a_policy_error() -> None:
    task = pb.Task(task_id="kernel")
    task.prompt.messages.add(role="user", content="compute it")
    task.reference_solution.add(name="python", arguments_json='{"code": "1 + 1"}')
    policy = ReplayPolicy([task], submit_command=SUBMIT)
    with pytest.raises(PolicyError, match="cannot replay a 'python' call"):
        await policy.generate(chatml([{"role": "user", "content": "compute it"}]), GenerateParams())


def test_every_bundled_answer_fits_a_turn_s_default_token_budget() -> None:
    """The byte tokenizer spends a token per byte: each answer of a bundled task, as mini gets it,
    fits DEFAULT_MAX_NEW_TOKENS (else the gateway cuts it and mini sees no tool call)."""
    tasks = load_tasks_jsonl(REPAIR_TASKS)
    policy = ReplayPolicy(tasks, submit_command=SUBMIT)
    for task in tasks:
        for index, call in enumerate(task.reference_solution):
            bash = as_bash_call(ToolCall(call.name, json.loads(call.arguments_json or "{}")), SUBMIT)
            answer = render_tool_calls([bash], ToolCallFormat.HERMES)
            assert len(TOK.encode(answer)) + 1 <= DEFAULT_MAX_NEW_TOKENS, (task.task_id, index)
    assert len(policy) == len(tasks)
