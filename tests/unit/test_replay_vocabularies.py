"""The replay policy answering in a harness's own tools (a vocabulary): each reference call as the
harness's call, and the end of the task as the vocabulary says (here a reply without tool calls,
as the coding CLIs end their tasks)."""

from __future__ import annotations

import json

import pytest

from corral.rollout.reference.policies import GenerateParams
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import make_policy
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary
from corral.rollout.tokenizer import IM_END, ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, parse_tool_calls
from corral.rollout.types import ToolCall
from corral.v1 import rollout_pb2 as pb

TOK = ByteChatTokenizer()


class ShellAndFinalText:
    """A harness whose only tool is `shell` {argv} and whose task ends on a plain reply."""

    name = "shell-and-text"

    def answer(self, call: ToolCall, workdir: str) -> ToolCall | str:
        if call.name == "submit":
            return FINAL_TEXT
        if call.name != "bash":
            raise ValueError(f"no {call.name} tool")
        return ToolCall("shell", {"argv": ["bash", "-lc", call.arguments["command"]], "cwd": workdir})


def task() -> pb.Task:
    task = pb.Task(task_id="t")
    task.prompt.messages.add(role="user", content="Make the tests pass.")
    task.reference_solution.add(name="bash", arguments_json=json.dumps({"command": "make test"}))
    return task


async def reply(policy: ReplayPolicy, conversation: list[tuple[str, str]]) -> str:
    prompt = TOK.encode_prompt([{"role": role, "content": content} for role, content in conversation])
    output = await policy.generate(prompt, GenerateParams(max_new_tokens=4096))
    assert output.output_ids[-1] == TOK.special_ids[IM_END]
    return TOK.decode(output.output_ids[:-1])


async def test_the_reference_calls_come_in_the_harness_s_tools_and_the_task_ends_in_its_way():
    policy = ReplayPolicy([task()], vocabulary=ShellAndFinalText(), workdir="/work/repo")
    conversation = [("system", "A coding CLI's own system prompt."), ("user", "Make the tests pass.")]
    first = await reply(policy, conversation)
    assert parse_tool_calls(first, ToolCallFormat.HERMES) == [
        ToolCall("shell", {"argv": ["bash", "-lc", "make test"], "cwd": "/work/repo"})
    ]
    conversation += [("assistant", first), ("tool", "ok")]
    assert await reply(policy, conversation) == FINAL_TEXT


async def test_a_call_the_vocabulary_cannot_express_fails_the_request_naming_the_task():
    solution = task()
    solution.reference_solution.add(name="python", arguments_json='{"code": "1"}')
    policy = ReplayPolicy([solution], vocabulary=ShellAndFinalText())
    conversation = [("user", "Make the tests pass."), ("assistant", "x"), ("tool", "ok")]
    with pytest.raises(ValueError, match="task 't', turn 1: no python tool"):
        await reply(policy, conversation)


def test_vocabularies_are_options_of_the_replay_policy_only_and_unknown_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        ReplayPolicy([task()], submit_command="echo done", vocabulary=ShellAndFinalText())
    with pytest.raises(ValueError, match="unknown tool vocabulary 'nope'"):
        vocabulary("nope")
    with pytest.raises(ValueError, match="options of the replay policy"):
        make_policy("tiny", vocabulary="codex")
