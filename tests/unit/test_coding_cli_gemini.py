"""Gemini CLI as a harness: how it is run (headless, approvals and its side calls off, its settings
file), and the replay policy's answers in its own tools, checked against the tool declarations
Gemini CLI 0.61 sends (their required arguments, recorded from its requests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from corral.rollout.coding_clis import coding_cli
from corral.rollout.reference.server import load_tasks_jsonl
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary
from corral.rollout.types import ToolCall

REPAIR_TASKS = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "repair.jsonl"
# The `required` of each parametersJsonSchema Gemini CLI 0.61.0 declares (from its requests).
REQUIRED = {
    "run_shell_command": {"command"},
    "replace": {"file_path", "instruction", "old_string", "new_string"},
    "write_file": {"file_path", "content"},
}


def test_the_cli_runs_headless_with_a_named_model_and_its_settings_under_gemini_cli_home():
    cli = coding_cli("gemini")
    assert (cli.package, cli.binary, cli.api, cli.vocabulary) == ("@google/gemini-cli", "gemini", "gemini", "gemini")
    parts = cli.parts("/opt/clis")
    assert parts.command[:2] == ["sh", "-c"]
    script = parts.command[2]
    assert script.startswith("exec /opt/clis/node_modules/.bin/gemini ")
    # A named model skips the router's classifier call; the prompt comes last, as -p's value.
    for flag in ('--model "$CORRAL_MODEL"', "--approval-mode yolo", "--skip-trust", "--output-format json"):
        assert flag in script
    assert script.endswith('-p "$CORRAL_TASK_PROMPT"')
    home = parts.env["GEMINI_CLI_HOME"]
    (path,) = parts.files
    assert path == f"{home}/.gemini/settings.json" and home.startswith("/tmp/")
    settings = json.loads(parts.files[path])
    assert settings["privacy"]["usageStatisticsEnabled"] is False
    assert settings["telemetry"]["enabled"] is False
    assert settings["general"] == {"enableAutoUpdate": False, "enableAutoUpdateNotification": False}
    assert settings["ide"]["enabled"] is False and settings["tools"]["sandbox"] is False
    assert settings["model"]["skipNextSpeakerCheck"] is True


def test_the_script_passes_the_prompt_as_one_argument():
    script = coding_cli("gemini").parts("/p").command[2].replace("exec /p/node_modules/.bin/gemini", "printf '%s\\n'")
    prompt = 'Fix "it"; $(touch /nope) and\nmore'
    env = {"CORRAL_MODEL": "corral", "CORRAL_TASK_PROMPT": prompt, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    expected = ["--model", "corral", "--approval-mode", "yolo", "--skip-trust", "--output-format", "json", "-p", prompt]
    assert out == "".join(f"{argument}\n" for argument in expected)


def test_edits_use_the_cli_s_own_tools_with_absolute_paths_and_the_rest_runs_in_its_shell():
    answer = vocabulary("gemini").answer
    replace = answer(
        ToolCall("editor", {"command": "str_replace", "path": "src/a.py", "old_str": "x", "new_str": "y"}), "/w"
    )
    assert isinstance(replace, ToolCall) and replace.name == "replace"
    assert replace.arguments["file_path"] == "/w/src/a.py"
    assert (replace.arguments["old_string"], replace.arguments["new_string"]) == ("x", "y")
    create = answer(ToolCall("editor", {"command": "create", "path": "b.py", "file_text": "z\n"}), "/w")
    assert create == ToolCall("write_file", {"file_path": "/w/b.py", "content": "z\n"})
    view = answer(ToolCall("editor", {"command": "view", "path": "b.py"}), "/w")
    assert isinstance(view, ToolCall) and view.name == "run_shell_command"
    assert view.arguments["command"].startswith("python3 -c ")
    assert answer(ToolCall("bash", {"command": "make test"}), "/w") == ToolCall(
        "run_shell_command", {"command": "make test"}
    )
    assert answer(ToolCall("submit", {}), "/w") == FINAL_TEXT
    with pytest.raises(ValueError, match="incomplete"):
        answer(ToolCall("editor", {"command": "str_replace", "path": "a.py"}), "/w")
    with pytest.raises(ValueError, match="python"):
        answer(ToolCall("python", {"code": "1"}), "/w")


def test_every_bundled_solution_is_expressed_with_the_arguments_the_cli_requires():
    answer = vocabulary("gemini").answer
    for task in load_tasks_jsonl(REPAIR_TASKS):
        for call in task.reference_solution:
            made = answer(ToolCall(call.name, json.loads(call.arguments_json)), "/workspace")
            if isinstance(made, str):
                assert made == FINAL_TEXT
                continue
            assert REQUIRED[made.name] <= set(made.arguments), (task.task_id, made)
            assert all(isinstance(value, str) and value for value in made.arguments.values()), (task.task_id, made)
