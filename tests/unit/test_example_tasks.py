"""The bundled example repair tasks (examples/tasks/repair.jsonl): the JSONL matches its sources,
every line is a well-formed Task, and every task is solvable and not solved from the start.

No daemon here: the sealed hidden tests run directly under /usr/bin/python3 (what the local
backend's sandbox sees) in a temporary directory, once on the buggy code (reward must be < 1) and
once after the reference solution's edits (reward must be 1.0), judged as the daemon judges them.
The run through the daemon is tested elsewhere (and attacked in test_reward_hacks.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from google.protobuf import json_format

from corral.rollout.observations import observations_reward
from corral.v1 import rollout_pb2

ROOT = Path(__file__).resolve().parents[2]
JSONL = ROOT / "examples" / "tasks" / "repair.jsonl"
SANDBOX_PYTHON = Path("/usr/bin/python3")


def _load_builder():
    spec = importlib.util.spec_from_file_location("build_example_tasks", ROOT / "scripts" / "build_example_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tasks() -> list[rollout_pb2.Task]:
    return [json_format.Parse(line, rollout_pb2.Task()) for line in JSONL.read_text(encoding="utf-8").splitlines()]


def test_jsonl_in_sync_with_sources():
    builder = _load_builder()
    assert JSONL.is_file(), "examples/tasks/repair.jsonl is missing: run scripts/build_example_tasks.py"
    assert JSONL.read_text(encoding="utf-8") == builder.render(), (
        "examples/tasks/repair.jsonl is stale: run scripts/build_example_tasks.py"
    )
    assert builder.in_sync()


def test_tasks_are_well_formed():
    tasks = _tasks()
    assert len(tasks) >= 20
    ids = [t.task_id for t in tasks]
    assert len(set(ids)) == len(ids), "duplicate task ids"
    assert ids == sorted(ids), "tasks must be sorted by task_id"
    printed_number = 0
    for task in tasks:
        where = task.task_id
        assert task.setup.files, where
        assert all(f.path and not f.path.startswith("/") and f.content for f in task.setup.files), where
        assert task.evaluation.files, where
        assert task.evaluation.commands, where
        assert task.evaluation.WhichOneof("reward") == "expected_observations", where
        printed_number += task.evaluation.expected_observations.partial_credit
        # Sealed: no assertion (with its expected operand) is left in a file the sandbox gets.
        hidden = b"".join(f.content for f in task.evaluation.files)
        assert b"self.assert" not in hidden, where
        for value in task.evaluation.expected_observations.expected.values():
            if len(value) > 12:
                assert value.encode() not in hidden, f"{where}: {value} is in an evaluation file"
        roles = [m.role for m in task.prompt.messages]
        assert roles == ["system", "user"], where
        assert set(task.tools) <= {"bash", "python", "editor", "submit"}, where
        assert {"difficulty", "topic"} <= set(task.metadata), where
        calls = list(task.reference_solution)
        assert calls and calls[-1].name == "submit", where
        assert any(c.name == "editor" for c in calls), where
        for call in calls:
            assert isinstance(json.loads(call.arguments_json), dict), where
        setup_paths = {f.path for f in task.setup.files}
        assert not setup_paths & {f.path for f in task.evaluation.files}, f"{where}: hidden files must be new"
    assert printed_number >= 3


def _run(command: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def _write(directory: Path, files) -> None:
    for f in files:
        path = directory / f.path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(f.content)


def _reward(task: rollout_pb2.Task, workdir: Path, env: dict[str, str]) -> tuple[float, str]:
    """Copies the evaluation files in, runs the commands, and scores the last one as the daemon
    would; returns the reward and the output (for failure messages)."""
    _write(workdir, task.evaluation.files)
    output = []
    for command in task.evaluation.commands:
        result = _run(command, workdir, env)
        output.append(f"$ {command} (exit {result.returncode})\n{result.stdout}{result.stderr}")
    rule = task.evaluation.expected_observations  # judged as the daemon judges it
    reward = observations_reward(result.stdout.encode(), rule.expected, partial_credit=rule.partial_credit)
    return reward, "\n".join(output)


def _apply_reference(task: rollout_pb2.Task, workdir: Path, env: dict[str, str]) -> None:
    for call in task.reference_solution:
        arguments = json.loads(call.arguments_json)
        if call.name == "editor":
            assert arguments["command"] == "str_replace", task.task_id
            path = workdir / arguments["path"]
            text = path.read_text(encoding="utf-8")
            count = text.count(arguments["old_str"])
            assert count == 1, f"{task.task_id}: old_str occurs {count} times in {arguments['path']}"
            path.write_text(text.replace(arguments["old_str"], arguments["new_str"]), encoding="utf-8")
        elif call.name == "bash":
            result = _run(arguments["command"], workdir, env)
            assert result.returncode == 0, f"{task.task_id}: reference command failed:\n{result.stdout}{result.stderr}"
        else:
            assert call.name == "submit", f"{task.task_id}: unexpected reference call {call.name}"


def _check_task(task: rollout_pb2.Task, root: Path, env: dict[str, str]) -> list[str]:
    """Problems with one task: the buggy code already passing, or the reference fix failing."""
    problems = []
    buggy, fixed = root / task.task_id / "buggy", root / task.task_id / "fixed"
    for workdir in (buggy, fixed):
        workdir.mkdir(parents=True)
        _write(workdir, task.setup.files)

    reward, output = _reward(task, buggy, env)
    if not 0.0 <= reward < 1.0:
        problems.append(f"{task.task_id}: the buggy code already gets reward {reward}\n{output}")

    _apply_reference(task, fixed, env)
    reward, output = _reward(task, fixed, env)
    if reward != 1.0:
        problems.append(f"{task.task_id}: the reference solution gets reward {reward}\n{output}")
    return problems


@pytest.mark.skipif(not SANDBOX_PYTHON.exists(), reason="the tasks run under /usr/bin/python3, which is missing")
def test_tasks_fail_before_and_pass_after_the_reference_fix(tmp_path):
    env = {"PATH": f"{SANDBOX_PYTHON.parent}:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    # The tasks are independent; a few at a time keeps the whole check to a few seconds.
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda task: _check_task(task, tmp_path, env), _tasks()))
    problems = [problem for result in results for problem in result]
    assert not problems, "\n\n".join(problems)
