"""The SWE-bench converter: instances become tasks that hide the test patch until evaluation and
score the named tests from a JUnit report. (Running such a task needs the instance's image, which
no registry here can provide; the path it takes, JUnit reward included, is covered by
tests/integration/test_rollouts.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from corral.sdk import InvalidArgument
from corral.sdk.swebench import GOLD_PATCH_PATH, TEST_PATCH_PATH, convert, instance_to_task
from corral.sdk.tasks import task_from, task_to_json
from corral.v1 import sandbox_pb2

INSTANCE: dict[str, Any] = {
    "instance_id": "acme__widgets-123",
    "repo": "acme/widgets",
    "base_commit": "0123abcd",
    "patch": "diff --git a/w.py b/w.py\n--- a/w.py\n+++ b/w.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n",
    "test_patch": "diff --git a/tests/test_w.py b/tests/test_w.py\n",
    "FAIL_TO_PASS": json.dumps(["tests/test_w.py::test_x"]),
    "PASS_TO_PASS": ["tests/test_w.py::test_y"],
    "problem_statement": "x should be 2 {not 1}",
}


def test_an_instance_becomes_a_docker_task_with_hidden_tests_and_a_junit_reward() -> None:
    task = instance_to_task(INSTANCE)
    assert task.task_id == "acme__widgets-123"
    assert task.backend == sandbox_pb2.BACKEND_DOCKER
    assert task.image == "swebench/sweb.eval.x86_64.acme__widgets-123:latest"
    assert [f.path for f in task.setup.files] == []  # nothing of the tests before the agent stops
    assert [f.path for f in task.evaluation.files] == [TEST_PATCH_PATH]
    assert task.evaluation.files[0].content == INSTANCE["test_patch"].encode()
    assert list(task.evaluation.junit.tests) == ["tests/test_w.py::test_x", "tests/test_w.py::test_y"]
    assert "tests/test_w.py::test_x" in task.evaluation.commands[-1]
    assert [c.name for c in task.reference_solution] == ["editor", "bash", "submit"]
    assert json.loads(task.reference_solution[0].arguments_json)["file_text"] == INSTANCE["patch"]
    assert GOLD_PATCH_PATH in json.loads(task.reference_solution[1].arguments_json)["command"]
    # The statement's braces are kept: it is a field value, not part of the template.
    assert task.prompt.fields["problem_statement"] == "x should be 2 {not 1}"
    assert task_from(task_to_json(task)) == task


def test_an_instance_naming_its_image_keeps_it() -> None:
    task = instance_to_task({**INSTANCE, "image_name": "local/widgets:123"})
    assert task.image == "local/widgets:123"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"patch": None}, "missing patch"),
        ({"FAIL_TO_PASS": "not json"}, "FAIL_TO_PASS is not a JSON list"),
        ({"PASS_TO_PASS": [1, 2]}, "PASS_TO_PASS must be a list"),
    ],
)
def test_bad_instances_name_the_problem(change: dict, message: str) -> None:
    instance = {**INSTANCE, **change}
    if change.get("patch", 0) is None:
        del instance["patch"]
    with pytest.raises(InvalidArgument, match=message):
        instance_to_task(instance)


def test_the_command_line_converts_jsonl(tmp_path) -> None:
    source = tmp_path / "instances.jsonl"
    source.write_text(json.dumps(INSTANCE) + "\n\n" + json.dumps({**INSTANCE, "instance_id": "b-1"}) + "\n")
    out = tmp_path / "tasks.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "corral.sdk.swebench", str(source), "--out", str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert [task_from(line).task_id for line in out.read_text().splitlines()] == ["acme__widgets-123", "b-1"]
    assert len(convert(source.read_text().splitlines())) == 2
