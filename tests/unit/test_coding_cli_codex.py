"""Codex CLI's harness parts (its command and config) and the replay policy's answers in Codex's
tools: shell commands as exec_command, whole-line edits as apply_patch patches, the rest as the
equivalent shell command, the end of the task as a plain reply. The real CLI runs them in
tests/integration/test_coding_cli_codex.py."""

from __future__ import annotations

import json
import subprocess
import tomllib

from corral.rollout.coding_clis import coding_cli, with_coding_cli
from corral.rollout.coding_clis.codex import CODEX_HOME
from corral.rollout.reference.bash_calls import as_bash_call
from corral.rollout.reference.server import load_tasks_jsonl
from corral.rollout.reference.vocabularies import FINAL_TEXT, vocabulary
from corral.rollout.types import ToolCall
from corral.v1 import rollout_pb2 as pb

CODEX = vocabulary("codex")


def editor(**arguments: object) -> ToolCall:
    return ToolCall("editor", dict(arguments))


def test_shell_commands_and_the_end_of_the_task():
    assert CODEX.answer(ToolCall("bash", {"command": "python3 -m unittest -q"}), "/workspace") == ToolCall(
        "exec_command", {"cmd": "python3 -m unittest -q"}
    )
    assert CODEX.answer(ToolCall("submit", {}), "/workspace") == FINAL_TEXT


def test_whole_line_edits_are_patches():
    replace = editor(command="str_replace", path="pkg/a.py", old_str="x = 1\ny = 2\n", new_str="x = 3\n")
    assert CODEX.answer(replace, "/workspace") == ToolCall(
        "apply_patch",
        {"input": "*** Begin Patch\n*** Update File: pkg/a.py\n@@\n-x = 1\n-y = 2\n+x = 3\n*** End Patch"},
    )
    delete = editor(command="str_replace", path="a.py", old_str="    pass\n", new_str="")
    assert CODEX.answer(delete, "/workspace").arguments["input"].endswith("@@\n-    pass\n*** End Patch")
    create = editor(command="create", path="new.py", file_text="a\n\nb\n")
    assert CODEX.answer(create, "/workspace") == ToolCall(
        "apply_patch", {"input": "*** Begin Patch\n*** Add File: new.py\n+a\n+\n+b\n*** End Patch"}
    )


def test_edits_a_patch_cannot_express_run_as_the_shell_equivalent(tmp_path):
    """Part of a line (apply_patch matches whole lines), text without a final newline, insert and
    view: the editor's command through exec_command, which really edits as the editor would."""
    (tmp_path / "a.py").write_text("value = compute(1)\n")
    cases = [
        editor(command="str_replace", path="a.py", old_str="compute(1)", new_str="compute(2)"),
        editor(command="str_replace", path="a.py", old_str="value = compute(2)\n", new_str="value = 3"),
        editor(command="create", path="b.py", file_text="no newline"),
        editor(command="insert", path="b.py", insert_line=0, new_str="first"),
        editor(command="view", path="b.py"),
    ]
    for call in cases:
        answer = CODEX.answer(call, "/workspace")
        assert isinstance(answer, ToolCall) and answer.name == "exec_command"
        assert answer.arguments == {"cmd": as_bash_call(call, "true").arguments["command"]}
        subprocess.run(["sh", "-c", answer.arguments["cmd"]], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "a.py").read_text() == "value = 3"
    assert (tmp_path / "b.py").read_text() == "first\nno newline"


def test_every_bundled_edit_is_a_patch_of_whole_lines():
    """The bundled solutions' edits replace whole lines that occur once, so each becomes a patch
    (the integration test applies them with Codex's own apply_patch)."""
    tasks = load_tasks_jsonl("examples/tasks/repair.jsonl")
    edits = [call for task in tasks for call in task.reference_solution if call.name == "editor"]
    answers = [CODEX.answer(ToolCall("editor", json.loads(call.arguments_json)), "/workspace") for call in edits]
    assert len(answers) == 29 and all(isinstance(a, ToolCall) and a.name == "apply_patch" for a in answers)


def test_the_cli_runs_headless_against_the_gateway_with_its_telemetry_off():
    cli = coding_cli("codex")
    assert (cli.npm_spec, cli.api, cli.vocabulary) == ("@openai/codex@0.171.0", "responses", "codex")
    parts = cli.parts("/opt/clis")
    assert parts.command[:2] == ["sh", "-c"]
    script = parts.command[2]
    assert script.startswith("exec /opt/clis/node_modules/.bin/codex exec ")
    for flag in (
        "--dangerously-bypass-approvals-and-sandbox",
        "--skip-git-repo-check",
        "--ephemeral",
        "--strict-config",
    ):
        assert flag in script
    assert script.endswith('"$CORRAL_TASK_PROMPT" </dev/null')  # codex exec reads more prompt from stdin
    assert parts.env == {"CODEX_HOME": CODEX_HOME}
    config = tomllib.loads(parts.files[f"{CODEX_HOME}/config.toml"].decode())
    assert config["model_provider"] == "corral"
    assert config["model_providers"]["corral"] == {
        "name": "corral",
        "env_key": "OPENAI_API_KEY",
        "wire_api": "responses",
    }
    assert config["check_for_update_on_startup"] is False and config["web_search"] == "disabled"
    assert config["analytics"] == {"enabled": False} and config["feedback"] == {"enabled": False}
    assert set(config["otel"].values()) == {"none"} and config["agents"] == {"enabled": False}
    assert not any(config["features"].values())
    # The gateway's URL is the rollout's, known only when the harness starts.
    shell = subprocess.run(
        ["sh", "-c", script.replace("exec /opt/clis/node_modules/.bin/codex", "printf '%s\\n'")],
        env={"OPENAI_BASE_URL": "http://127.0.0.1:9/v1", "CORRAL_TASK_PROMPT": "Fix it.", "CORRAL_WORKDIR": "/w"},
        capture_output=True,
        text=True,
        check=True,
    )
    argv = shell.stdout.splitlines()
    assert argv[argv.index("-c") + 1] == 'model_providers.corral.base_url="http://127.0.0.1:9/v1"'
    assert argv[argv.index("-C") + 1] == "/w" and argv[-1] == "Fix it."
    task = with_coding_cli(pb.Task(task_id="t"), "codex", "/opt/clis")
    assert task.harness.place == pb.HARNESS_PLACE_SANDBOX
