"""Claude Code as a harness task (its command, environment) and the replay policy's answers in its
tools (the `claude` vocabulary), without the CLI itself (tests/integration/test_coding_cli_claude.py
runs it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from corral.rollout.coding_clis import coding_cli
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.server import load_tasks_jsonl
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary
from corral.rollout.tasks import task_prompt_text
from corral.rollout.tokenizer import ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, parse_tool_calls
from corral.rollout.types import ToolCall

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
TOK = ByteChatTokenizer()
CLAUDE = vocabulary("claude")


def test_the_command_runs_the_binary_headless_with_the_prompt_and_model_from_the_environment(tmp_path):
    cli = coding_cli("claude")
    assert (cli.api, cli.vocabulary, cli.npm_spec) == ("messages", "claude", "@anthropic-ai/claude-code@2.1.332")
    # A stand-in binary that prints its argv shows what the shell passes it.
    binary = tmp_path / "node_modules" / ".bin" / "claude"
    binary.parent.mkdir(parents=True)
    binary.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    binary.chmod(0o755)
    parts = cli.parts(str(tmp_path))
    prompt = 'Fix it: `rm -rf $HOME` is "quoted"\nand on two lines.'
    env = {"CORRAL_TASK_PROMPT": prompt, "CORRAL_MODEL": "policy", "PATH": "/usr/bin:/bin"}
    printed = subprocess.run(parts.command, env=env, capture_output=True, text=True, check=True).stdout
    assert printed == "\n".join(
        [
            "-p",
            prompt,
            "--model",
            "policy",
            "--output-format",
            "stream-json",
            "--verbose",
            "--dangerously-skip-permissions",
            "--no-session-persistence",
            "",
        ]
    )
    assert parts.env["IS_SANDBOX"] == "1" and parts.env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert {"DISABLE_AUTOUPDATER", "DISABLE_TELEMETRY", "DISABLE_ERROR_REPORTING"} <= set(parts.env)
    assert parts.env["CLAUDE_CONFIG_DIR"].startswith("/tmp/")


def test_editor_calls_become_edit_and_write_with_absolute_paths_in_claude_code_s_argument_order():
    edit = CLAUDE.answer(
        ToolCall("editor", {"command": "str_replace", "path": "a.py", "old_str": "x", "new_str": "y"}), "/w"
    )
    assert isinstance(edit, ToolCall) and edit.name == "Edit"
    # As Claude Code sends it back: its default first, then the rest.
    assert list(edit.arguments.items()) == [
        ("replace_all", False),
        ("file_path", "/w/a.py"),
        ("old_string", "x"),
        ("new_string", "y"),
    ]
    write = CLAUDE.answer(ToolCall("editor", {"command": "create", "path": "d/n.py", "file_text": "1\n"}), "/w")
    assert write == ToolCall("Write", {"file_path": "/w/d/n.py", "content": "1\n"})


def test_bash_view_and_insert_are_bash_calls_and_submit_is_the_final_text():
    assert CLAUDE.answer(ToolCall("bash", {"command": "make"}), "/w") == ToolCall("Bash", {"command": "make"})
    view = CLAUDE.answer(ToolCall("editor", {"command": "view", "path": "a.py"}), "/w")
    assert isinstance(view, ToolCall) and view.name == "Bash" and view.arguments["command"].startswith("python3 -c")
    insert = CLAUDE.answer(
        ToolCall("editor", {"command": "insert", "path": "a.py", "insert_line": 1, "new_str": "z"}), "/w"
    )
    assert isinstance(insert, ToolCall) and insert.name == "Bash"
    assert CLAUDE.answer(ToolCall("submit", {}), "/w") == FINAL_TEXT
    with pytest.raises(ValueError, match="cannot replay a 'python' call"):
        CLAUDE.answer(ToolCall("python", {"code": "1"}), "/w")


async def test_the_replay_policy_answers_every_bundled_task_in_claude_code_s_tools():
    tasks = load_tasks_jsonl(REPAIR_TASKS)
    policy = ReplayPolicy(tasks, vocabulary=CLAUDE, workdir="/workspace")
    for task in tasks:
        conversation = [{"role": "system", "content": "Claude Code's prompt."}]
        conversation.append({"role": "user", "content": task_prompt_text(task)})
        answers = []
        for _ in range(len(task.reference_solution)):
            _, ids = policy.answer(TOK.encode_prompt(conversation))
            text = TOK.decode(ids[:-1])
            answers.append(text)
            conversation += [{"role": "assistant", "content": text}, {"role": "tool", "content": "ok"}]
        *calls, final = answers
        assert final == FINAL_TEXT, task.task_id
        for text, reference in zip(calls, task.reference_solution):
            (call,) = parse_tool_calls(text, ToolCallFormat.HERMES)
            expected = json.loads(reference.arguments_json)
            if reference.name == "editor":
                assert call.name == "Edit" and call.arguments["file_path"] == "/workspace/" + expected["path"]
                assert (call.arguments["old_string"], call.arguments["new_string"]) == (
                    expected["old_str"],
                    expected["new_str"],
                )
            else:
                assert call == ToolCall("Bash", {"command": expected["command"]})
