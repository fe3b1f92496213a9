"""The SWE-bench converter: instances become tasks that hide the test patch until evaluation and
score the named tests from a JUnit report. (Tasks of the SWE-bench-style test image,
examples/swe, run end to end in tests/integration/test_swe_image.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from corral.rollout.evaluation import junit_reward
from corral.sdk import InvalidArgument
from corral.sdk.swebench import (
    DEFAULT_ACTIVATE,
    GOLD_PATCH_PATH,
    TEST_PATCH_PATH,
    convert,
    instance_to_task,
    patch_paths,
)
from corral.sdk.tasks import task_from, task_to_json
from corral.v1 import rollout_pb2, sandbox_pb2

EXAMPLE = Path(__file__).parents[2] / "examples" / "swe" / "instances.jsonl"

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
    # Resolved or not, as SWE-bench scores; the environment is activated by name, not by an rc file.
    assert task.evaluation.junit.all_must_pass
    assert f"cd /testbed && {DEFAULT_ACTIVATE} && python -m pytest" in task.evaluation.commands[-1]
    # Judged in a clean sandbox of the image with the agent's change to /testbed; the files the
    # test patch touches are never taken from the agent.
    assert task.evaluation.isolation == rollout_pb2.EVALUATION_ISOLATION_CLEAN_SANDBOX
    assert task.evaluation.change.root == "/testbed"
    assert list(task.evaluation.change.protected_paths) == ["tests/test_w.py"]
    assert task_from(task_to_json(task)) == task


def test_the_files_a_patch_touches_old_and_new_names() -> None:
    patch = (
        "diff --git a/tests/old.py b/tests/new.py\nsimilarity index 90%\nrename from tests/old.py\n"
        "rename to tests/new.py\n--- a/tests/old.py\n+++ b/tests/new.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/tests/added.py b/tests/added.py\nnew file mode 100644\n--- /dev/null\n+++ b/tests/added.py\n"
        "--- plain/diff.txt\t2024-01-01\n+++ plain/diff.txt\t2024-01-02\n"
    )
    assert patch_paths(patch) == ["tests/old.py", "tests/new.py", "tests/added.py", "plain/diff.txt"]
    assert patch_paths(json.loads(EXAMPLE.read_text())["test_patch"]) == ["tests/test_slug.py"]


def test_the_image_is_mapped_to_what_the_backend_runs() -> None:
    task = instance_to_task(INSTANCE, backend="singularity", image_map="/images/{image_file}.sif")
    assert task.backend == sandbox_pb2.BACKEND_SINGULARITY
    assert task.image == "/images/sweb.eval.x86_64.acme__widgets-123_latest.sif"
    task = instance_to_task(
        {**INSTANCE, "image_name": "local/widgets:123"}, backend="local", image_map="/rootfs/{image_file}"
    )
    assert (task.backend, task.image) == (sandbox_pb2.BACKEND_LOCAL, "/rootfs/widgets_123")


def test_activation_and_partial_credit_are_options() -> None:
    task = instance_to_task(INSTANCE, activate=". /opt/venv/bin/activate", partial_credit=True)
    assert "cd /testbed && . /opt/venv/bin/activate && python -m pytest" in task.evaluation.commands[-1]
    assert not task.evaluation.junit.all_must_pass
    assert "cd /testbed && python -m pytest" in instance_to_task(INSTANCE, activate="").evaluation.commands[-1]


def test_all_must_pass_scores_resolved_or_not() -> None:
    report = b"""<testsuite>
<testcase classname="tests.test_w" name="test_x"/>
<testcase classname="tests.test_w" name="test_y"><failure/></testcase>
</testsuite>"""
    tests = ["tests/test_w.py::test_x", "tests/test_w.py::test_y"]
    assert junit_reward(report, tests) == 0.5
    assert junit_reward(report, tests, all_must_pass=True) == 0.0
    assert junit_reward(report, tests[:1], all_must_pass=True) == 1.0
    # A named test missing from the report fails it.
    assert junit_reward(report, [*tests[:1], "tests/test_w.py::test_z"], all_must_pass=True) == 0.0


def test_the_example_instance_converts() -> None:
    (task,) = convert(EXAMPLE.read_text().splitlines(), activate=". /opt/venv/bin/activate")
    assert task.image == "corral-test/swe-textkit:bookworm"
    assert len(task.evaluation.junit.tests) == 6


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


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"backend": "podman"}, "backend must be one of local, docker, singularity"),
        ({"image_map": "/images/{name}.sif"}, r"image map .* cannot be filled in .*its fields: \{image\}"),
        ({"image_pattern": "x/{id}"}, "image pattern .* cannot be filled in"),
    ],
)
def test_bad_options_name_the_problem(options: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        instance_to_task(INSTANCE, **options)


def test_the_command_line_converts_jsonl(tmp_path) -> None:
    source = tmp_path / "instances.jsonl"
    source.write_text(json.dumps(INSTANCE) + "\n\n" + json.dumps({**INSTANCE, "instance_id": "b-1"}) + "\n")
    out = tmp_path / "tasks.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "corral.sdk.swebench", str(source), "--out", str(out)]
        + ["--backend", "singularity", "--image-map", "/sif/{image_file}.sif", "--activate", "", "--partial-credit"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    tasks = [task_from(line) for line in out.read_text().splitlines()]
    assert [task.task_id for task in tasks] == ["acme__widgets-123", "b-1"]
    assert tasks[1].image == "/sif/sweb.eval.x86_64.b-1_latest.sif"
    assert tasks[1].backend == sandbox_pb2.BACKEND_SINGULARITY
    assert not tasks[1].evaluation.junit.all_must_pass
    assert "cd /testbed && python -m pytest" in tasks[1].evaluation.commands[-1]
    assert len(convert(source.read_text().splitlines())) == 2
