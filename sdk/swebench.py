"""SWE-bench-style instances → corral tasks.

An instance (one JSON object per line, as the SWE-bench datasets ship them) has instance_id, repo,
base_commit, patch (the gold fix), test_patch (the tests that check it), FAIL_TO_PASS and
PASS_TO_PASS (pytest ids, as lists or JSON-encoded lists), problem_statement, and an image name
(`image_name`, else `image`, else the SWE-bench naming scheme). The images hold the repository at
`base_commit` in /testbed, owned by root, with its environment ready (SWE-bench's: a conda
environment `testbed`, activated from /root/.bashrc for the agent's shell).

The task it becomes: a sandbox from that image (Docker, or the image mapped to what another backend
runs: a SIF or root filesystem path); the problem statement as the prompt; tools bash, editor and
submit. The test patch is hidden until evaluation: it is copied in and applied only after the
agent stops, then pytest runs FAIL_TO_PASS + PASS_TO_PASS with a JUnit report, in the environment
the activation command sets up (named explicitly: evaluation reads no rc file). The reward is 1.0
when all of them pass (resolved), else 0, or with partial credit the fraction that pass. The
reference solution applies the gold patch, so the replay policy can check the whole path.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from corral.sdk.enums import BACKEND_NAMES, backend_number
from corral.sdk.errors import InvalidArgument
from corral.sdk.tasks import task_to_json
from corral.v1 import rollout_pb2 as pb

DEFAULT_WORKDIR = "/testbed"
DEFAULT_IMAGE_PATTERN = "swebench/sweb.eval.x86_64.{instance_id_lower}:latest"
# What SWE-bench's own evaluation runs before the tests. Evaluation starts from a fresh
# environment (rollout/evaluation.py), so the environment is activated by this command, never by
# sourcing an rc file the agent may have edited.
DEFAULT_ACTIVATE = ". /opt/miniconda3/bin/activate && conda activate testbed"
# The image each backend gets: {image} is the instance's (Docker) image name, {image_file} its
# last path component with ":" as "_" (how `apptainer pull` names a SIF), and {instance_id},
# {instance_id_lower} as in the image pattern.
DEFAULT_IMAGE_MAP = "{image}"
BACKENDS = BACKEND_NAMES  # every backend of the contract (corral.v1's Backend enum)
TEST_PATCH_PATH = "/tmp/corral_eval/test.patch"
GOLD_PATCH_PATH = "/tmp/corral_gold.patch"
REPORT_PATH = "/tmp/corral_eval/report.xml"

SYSTEM_PROMPT = (
    "You are a software engineer working in the repository at {workdir}. Resolve the issue below by "
    "editing the source code. Do not change the tests. When you are done, call submit."
)
USER_PROMPT = "Repository: {repo} (at commit {base_commit})\n\n<issue>\n{problem_statement}\n</issue>"
REQUIRED = ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")


def _test_ids(value: Any, field: str, instance_id: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InvalidArgument(f"{instance_id}: {field} is not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidArgument(f"{instance_id}: {field} must be a list of test ids")
    return value


def patch_paths(patch: str) -> list[str]:
    """The files a unified diff (git's, or diff -u's) touches, old and new names, relative to the
    repository."""
    paths: dict[str, None] = {}
    for line in patch.splitlines():
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t", 1)[0].strip()
            if name != "/dev/null":
                paths[name.split("/", 1)[1] if name[:2] in ("a/", "b/") else name] = None
        elif line.startswith("rename from ") or line.startswith("rename to "):
            paths[line.split(" ", 2)[2]] = None
        elif line.startswith("diff --git a/") and " b/" in line:
            old, new = line[len("diff --git a/") :].split(" b/", 1)
            paths[old] = paths[new] = None
    return list(paths)


def _fill(template: str, option: str, **names: str) -> str:
    try:
        return template.format(**names)
    except (KeyError, IndexError, ValueError) as error:
        fields = ", ".join(f"{{{name}}}" for name in names)
        raise InvalidArgument(f"{option} {template!r} cannot be filled in ({error!r}); its fields: {fields}") from None


def instance_to_task(
    instance: Mapping[str, Any],
    *,
    workdir: str = DEFAULT_WORKDIR,
    image_pattern: str = DEFAULT_IMAGE_PATTERN,
    max_turns: int = 50,
    backend: str = "docker",
    image_map: str = DEFAULT_IMAGE_MAP,
    activate: str = DEFAULT_ACTIVATE,
    partial_credit: bool = False,
) -> pb.Task:
    """The corral task for one SWE-bench-style instance, on `backend` with the image `image_map`
    makes of the instance's. InvalidArgument names what is missing or wrong."""
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    missing = [key for key in REQUIRED if key not in instance]
    if missing:
        raise InvalidArgument(f"{instance.get('instance_id', '<no instance_id>')}: missing {', '.join(missing)}")
    instance_id = str(instance["instance_id"])
    fail_to_pass = _test_ids(instance["FAIL_TO_PASS"], "FAIL_TO_PASS", instance_id)
    pass_to_pass = _test_ids(instance["PASS_TO_PASS"], "PASS_TO_PASS", instance_id)
    names = {"instance_id": instance_id, "instance_id_lower": instance_id.lower()}
    image = str(instance.get("image_name") or instance.get("image") or _fill(image_pattern, "image pattern", **names))
    image_file = image.rsplit("/", 1)[-1].replace(":", "_")

    task = pb.Task(
        task_id=instance_id,
        backend=backend_number(backend),
        image=_fill(image_map, "image map", image=image, image_file=image_file, **names),
        tools=["bash", "editor", "submit"],
        limits=pb.TaskLimits(max_turns=max_turns),
    )
    task.prompt.messages.add(role="system", content=SYSTEM_PROMPT)
    task.prompt.messages.add(role="user", content=USER_PROMPT)
    task.prompt.fields.update(
        {
            "workdir": workdir,
            "repo": str(instance["repo"]),
            "base_commit": str(instance["base_commit"]),
            "problem_statement": str(instance.get("problem_statement", "")),
        }
    )
    tests = fail_to_pass + pass_to_pass
    quoted_dir = shlex.quote(workdir)
    task.evaluation.files.add(path=TEST_PATCH_PATH, content=str(instance["test_patch"]).encode())
    task.evaluation.commands.extend(
        [
            # The test files are put back as they were at base_commit, so the agent cannot have
            # changed what checks it, then the hidden test patch is applied.
            f"cd {quoted_dir} && for f in $(git apply --numstat {TEST_PATCH_PATH} | cut -f3); do "
            f'git checkout -q {shlex.quote(str(instance["base_commit"]))} -- "$f" 2>/dev/null || rm -f "$f"; done '
            f"&& git apply {TEST_PATCH_PATH}",
            f"cd {quoted_dir} && {activate + ' && ' if activate else ''}python -m pytest -q -rA --junitxml={REPORT_PATH} "
            + " ".join(shlex.quote(test) for test in tests)
            + " || true",
        ]
    )
    task.evaluation.junit.report_path = REPORT_PATH
    # Evaluation runs in a clean sandbox of the image with the agent's change to the repository
    # applied; what the test patch touches is never taken from the agent.
    task.evaluation.isolation = pb.EVALUATION_ISOLATION_CLEAN_SANDBOX
    task.evaluation.change.root = workdir
    task.evaluation.change.protected_paths.extend(patch_paths(str(instance["test_patch"])))
    task.evaluation.junit.tests.extend(tests)
    task.evaluation.junit.all_must_pass = not partial_credit
    task.reference_solution.extend(
        [
            pb.ToolCall(
                name="editor",
                arguments_json=json.dumps(
                    {"command": "create", "path": GOLD_PATCH_PATH, "file_text": str(instance["patch"])}
                ),
            ),
            pb.ToolCall(
                name="bash", arguments_json=json.dumps({"command": f"cd {quoted_dir} && git apply {GOLD_PATCH_PATH}"})
            ),
            pb.ToolCall(name="submit", arguments_json="{}"),
        ]
    )
    task.metadata.update(
        {"source": "swe-bench", "repo": str(instance["repo"]), "base_commit": str(instance["base_commit"])}
    )
    return task


def convert(lines: Iterable[str], **options: Any) -> list[pb.Task]:
    tasks = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            instance = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidArgument(f"line {number}: not JSON ({error.msg})") from None
        tasks.append(instance_to_task(instance, **options))
    return tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m corral.sdk.swebench", description=__doc__.split("\n\n")[0])
    parser.add_argument("instances", help="JSONL of SWE-bench-style instances ('-': standard input)")
    parser.add_argument("--out", default="-", help="tasks JSONL to write ('-': standard output)")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR)
    parser.add_argument(
        "--image-pattern",
        default=DEFAULT_IMAGE_PATTERN,
        help="image of instances that name none; {instance_id} and {instance_id_lower} are filled in",
    )
    parser.add_argument("--max-turns", type=int, default=50)
    parser.add_argument("--backend", choices=BACKENDS, default="docker")
    parser.add_argument(
        "--image-map",
        default=DEFAULT_IMAGE_MAP,
        help="the image the backend runs, from the instance's: {image}, {image_file} (last path component, "
        "':' as '_', as `apptainer pull` names a SIF), {instance_id}, {instance_id_lower}; "
        "e.g. '/images/{image_file}.sif' for singularity",
    )
    parser.add_argument(
        "--activate",
        default=DEFAULT_ACTIVATE,
        help="shell command that activates the test environment before pytest runs ('': none)",
    )
    parser.add_argument(
        "--partial-credit", action="store_true", help="reward the fraction of the tests that pass, not all or nothing"
    )
    args = parser.parse_args(argv)
    source = sys.stdin if args.instances == "-" else open(args.instances, encoding="utf-8")
    with source:
        try:
            # Every option but the two files is a keyword of instance_to_task, under its name.
            options = {name: value for name, value in vars(args).items() if name not in ("instances", "out")}
            tasks = convert(source, **options)
        except InvalidArgument as error:
            print(f"swebench: {error}", file=sys.stderr)
            return 2
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    with out:
        for task in tasks:
            out.write(task_to_json(task) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
