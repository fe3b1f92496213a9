"""Qwen Code's and Pi's vocabularies: each reference call as the CLI's own tool call (the argument
shapes their requests declare, logged from the CLIs themselves: docs/coding-clis.md), a reply of
several calls where the CLI needs it, and the replay policy rendering such a reply; and the
harness parts that run each headless with its telemetry and update checks off."""

from __future__ import annotations

import json
import shlex

from corral.rollout.coding_clis import coding_cli
from corral.rollout.reference.policies import GenerateParams
from corral.rollout.reference.replay import ReplayPolicy
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary
from corral.rollout.tokenizer import IM_END, ByteChatTokenizer
from corral.rollout.tool_calls import ToolCallFormat, parse_tool_calls
from corral.rollout.types import ToolCall
from corral.v1 import rollout_pb2 as pb

EDIT = ToolCall("editor", {"command": "str_replace", "path": "pkg/mod.py", "old_str": "a - b", "new_str": "a + b"})
CREATE = ToolCall("editor", {"command": "create", "path": "new.py", "file_text": "x = 1\n"})
INSERT = ToolCall("editor", {"command": "insert", "path": "mod.py", "insert_line": 2, "new_str": "y = 2"})
BASH = ToolCall("bash", {"command": "python3 -m unittest"})
SUBMIT = ToolCall("submit", {})


def test_qwen_edits_with_a_read_first_and_absolute_paths():
    qwen = vocabulary("qwen")
    assert qwen.answer(EDIT, "/workspace") == [
        ToolCall("read_file", {"file_path": "/workspace/pkg/mod.py"}),
        ToolCall("edit", {"file_path": "/workspace/pkg/mod.py", "old_string": "a - b", "new_string": "a + b"}),
    ]
    assert qwen.answer(CREATE, "/workspace") == ToolCall(
        "write_file", {"file_path": "/workspace/new.py", "content": "x = 1\n"}
    )
    assert qwen.answer(BASH, "/workspace") == ToolCall("run_shell_command", {"command": "python3 -m unittest"})
    insert = qwen.answer(INSERT, "/workspace")
    assert isinstance(insert, ToolCall) and insert.name == "run_shell_command"
    assert shlex.split(insert.arguments["command"])[-3:] == ["mod.py", "2", "y = 2"]
    assert qwen.answer(SUBMIT, "/workspace") == FINAL_TEXT


def test_pi_edits_with_its_edits_list_and_relative_paths():
    pi = vocabulary("pi")
    assert pi.answer(EDIT, "/workspace") == ToolCall(
        "edit", {"path": "pkg/mod.py", "edits": [{"oldText": "a - b", "newText": "a + b"}]}
    )
    assert pi.answer(CREATE, "/workspace") == ToolCall("write", {"path": "new.py", "content": "x = 1\n"})
    assert pi.answer(BASH, "/workspace") == ToolCall("bash", {"command": "python3 -m unittest"})
    insert = pi.answer(INSERT, "/workspace")
    assert isinstance(insert, ToolCall) and insert.name == "bash" and "python3 -c" in insert.arguments["command"]
    assert pi.answer(SUBMIT, "/workspace") == FINAL_TEXT


async def test_a_reply_of_several_calls_is_rendered_as_one_answer():
    tokenizer = ByteChatTokenizer()
    task = pb.Task(task_id="t")
    task.prompt.messages.add(role="user", content="Fix mod.py.")
    task.reference_solution.add(name="editor", arguments_json=json.dumps(EDIT.arguments))
    policy = ReplayPolicy([task], vocabulary=vocabulary("qwen"), workdir="/w")
    output = await policy.generate(
        tokenizer.encode_prompt([{"role": "user", "content": "Fix mod.py."}]), GenerateParams(4096)
    )
    assert output.output_ids[-1] == tokenizer.special_ids[IM_END]
    calls = parse_tool_calls(tokenizer.decode(output.output_ids[:-1]), ToolCallFormat.HERMES)
    assert [call.name for call in calls] == ["read_file", "edit"]


def test_qwen_runs_headless_with_statistics_telemetry_updates_and_background_agents_off():
    parts = coding_cli("qwen").parts("/opt/clis")
    assert parts.command == ["sh", "-c", 'exec /opt/clis/node_modules/.bin/qwen --yolo -p "$CORRAL_TASK_PROMPT"']
    assert parts.env["QWEN_USAGE_STATISTICS_ENABLED"] == parts.env["QWEN_TELEMETRY_ENABLED"] == "0"
    settings = json.loads(parts.files[parts.env["HOME"] + "/.qwen/settings.json"])
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["telemetry"]["enabled"] is False
    assert settings["general"]["enableAutoUpdate"] is False
    assert set(settings["memory"].values()) == {False}
    assert settings["security"]["auth"]["selectedType"] == "openai"


def test_pi_runs_offline_without_telemetry_or_compaction_against_the_gateway_s_url():
    parts = coding_cli("pi").parts("/opt/clis")
    (script,) = parts.command[2:]
    assert parts.command[:2] == ["sh", "-c"] and "/opt/clis/node_modules/.bin/pi -p --mode json --no-session" in script
    assert (parts.env["PI_OFFLINE"], parts.env["PI_TELEMETRY"]) == ("1", "0")
    agent_dir = parts.env["PI_CODING_AGENT_DIR"]
    settings = json.loads(parts.files[agent_dir + "/settings.json"])
    assert settings == {"enableInstallTelemetry": False, "compaction": {"enabled": False}}
    configure = parts.files[agent_dir + "/configure.mjs"].decode()
    assert "process.env.OPENAI_BASE_URL" in configure and '"openai-completions"' in configure
