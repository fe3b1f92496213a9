"""Builds examples/tasks/repair.jsonl from the task sources under examples/tasks/src/.

Run from anywhere: `python scripts/build_example_tasks.py` writes the JSONL; with `--check` it
writes nothing and exits 1 when the committed file differs from what it would write (CI and
tests/unit/test_example_tasks.py use that).

Each task is a folder examples/tasks/src/<task_id>/ with
  repo/       the files the sandbox starts with (Task.setup.files, paths relative to repo/),
  hidden/     unittest tests, sealed (corral.rollout.observations) into the evaluation files
              copied in after the agent stops (Task.evaluation.files),
  task.json   everything else, in a readable form (see examples/tasks/README.md).
The expected observations come from running the sealed tests against the reference solution here,
with this Python; the buggy code must fail them. The output has one corral.v1.Task per line in the
proto3 JSON mapping (proto field names, file contents base64), sorted by task_id, so the same
sources always give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from google.protobuf import json_format

from corral.rollout import observations
from corral.v1 import rollout_pb2

ROOT = Path(__file__).resolve().parent.parent
SRC_DIR = ROOT / "examples" / "tasks" / "src"
OUT_PATH = ROOT / "examples" / "tasks" / "repair.jsonl"

# all_tests: 1.0 when every hidden test passes, else 0.0; share_of_tests: the fraction that pass.
REWARDS = ("all_tests", "share_of_tests")
RUNNER_PATH = f"tests_hidden/{observations.RUNNER_NAME}"
EVAL_COMMAND = f"python3 -I {RUNNER_PATH}"
TOOLS = ("bash", "python", "editor", "submit")
_TASK_KEYS = {"task_id", "metadata", "tools", "limits", "prompt", "evaluation", "reference_solution"}
_REQUIRED_KEYS = {"task_id", "prompt", "evaluation", "reference_solution"}
# "{{", "}}", a "{name}" placeholder, or a stray brace (an error).
_BRACES = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|[{}]")


class TaskSourceError(ValueError):
    """A task folder is malformed; the message names the task and the problem."""


def _files(directory: Path) -> list[rollout_pb2.TaskFile]:
    """The files under `directory` (recursively, sorted), paths relative to it."""
    paths = sorted(
        p for p in directory.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    return [rollout_pb2.TaskFile(path=p.relative_to(directory).as_posix(), content=p.read_bytes()) for p in paths]


def _check_placeholders(task_id: str, text: str, fields: dict[str, str]) -> None:
    for match in _BRACES.finditer(text):
        token, name = match.group(0), match.group(1)
        if token in ("{{", "}}"):
            continue
        if name is None:
            raise TaskSourceError(
                f"{task_id}: stray {token!r} in a prompt message (write {token * 2} for a literal brace)"
            )
        if name not in fields:
            raise TaskSourceError(f"{task_id}: prompt placeholder {{{name}}} has no field")


def _check_reference(task_id: str, calls: list[dict], repo_files: dict[str, bytes]) -> dict[str, bytes]:
    """The repo's files after the reference solution's edits. The reference ends in submit, and
    each str_replace edit applies (its old_str occurs exactly once in the file as the earlier edits
    left it)."""
    if not calls or calls[-1].get("name") != "submit":
        raise TaskSourceError(f"{task_id}: the reference solution must end with a submit call")
    contents = {path: data.decode("utf-8") for path, data in repo_files.items()}
    for index, call in enumerate(calls):
        name, arguments = call.get("name"), call.get("arguments", {})
        if set(call) - {"name", "arguments"} or name not in TOOLS or not isinstance(arguments, dict):
            raise TaskSourceError(f"{task_id}: reference call {index} must be {{name, arguments}} with a known tool")
        if name != "editor":
            continue
        if arguments.get("command") != "str_replace":
            raise TaskSourceError(f"{task_id}: reference call {index}: only editor str_replace is supported")
        path, old, new = arguments.get("path"), arguments.get("old_str"), arguments.get("new_str")
        if path not in contents:
            raise TaskSourceError(f"{task_id}: reference call {index} edits {path!r}, which is not in repo/")
        occurrences = contents[path].count(old) if isinstance(old, str) and old else 0
        if not isinstance(old, str) or occurrences != 1:
            raise TaskSourceError(
                f"{task_id}: reference call {index}: old_str occurs {occurrences} times in {path}, not once"
            )
        if not isinstance(new, str):
            raise TaskSourceError(f"{task_id}: reference call {index}: new_str is missing or not a string")
        contents[path] = contents[path].replace(old, new)
    return {path: text.encode("utf-8") for path, text in contents.items()}


def _sealed(task_id: str, hidden: list[rollout_pb2.TaskFile]) -> list[rollout_pb2.TaskFile]:
    """The hidden tests sealed (their expected operands dropped), plus the runner."""
    files = []
    for file in hidden:
        name = file.path.rsplit("/", 1)[-1]
        content = file.content
        if name.startswith("test") and name.endswith(".py"):
            try:
                content = observations.seal_unittest_source(content.decode("utf-8"), f"{task_id}/{file.path}").encode()
            except observations.SealError as error:
                raise TaskSourceError(str(error)) from None
        files.append(rollout_pb2.TaskFile(path=file.path, content=content))
    runner = observations.OBSERVATION_RUNNER.read_bytes()
    return [*files, rollout_pb2.TaskFile(path=RUNNER_PATH, content=runner)]


def _observe(files: dict[str, bytes], hidden: list[rollout_pb2.TaskFile]) -> subprocess.CompletedProcess:
    """The sealed tests run on `files` (with this Python, isolated); exit 1 when a test failed."""
    return observations.run_sealed({**files, **{f.path: f.content for f in hidden}}, RUNNER_PATH)


def _expected(task_id: str, buggy: dict[str, bytes], fixed: dict[str, bytes], hidden: list[rollout_pb2.TaskFile]):
    """Observation key → value on the reference solution; every test must pass there and some
    test must fail on the buggy code."""
    reference = _observe(fixed, hidden)
    if reference.returncode != 0:
        raise TaskSourceError(f"{task_id}: the reference solution fails the hidden tests:\n{reference.stderr.decode()}")
    try:
        expected = observations.expected_from(reference.stdout)
    except observations.SealError as error:
        raise TaskSourceError(f"{task_id}: {error}") from None
    if not expected:
        raise TaskSourceError(f"{task_id}: the hidden tests observe nothing")
    if observations.observations_reward(_observe(buggy, hidden).stdout, expected, partial_credit=False) == 1.0:
        raise TaskSourceError(f"{task_id}: the buggy code already passes the hidden tests")
    return expected


def load_task(task_dir: Path) -> rollout_pb2.Task:
    """The Task a source folder describes; TaskSourceError when it is malformed."""
    task_id = task_dir.name
    spec = json.loads((task_dir / "task.json").read_text(encoding="utf-8"))
    if unknown := set(spec) - _TASK_KEYS:
        raise TaskSourceError(f"{task_id}: unknown keys in task.json: {sorted(unknown)}")
    if missing := _REQUIRED_KEYS - set(spec):
        raise TaskSourceError(f"{task_id}: task.json lacks {sorted(missing)}")
    if spec["task_id"] != task_id:
        raise TaskSourceError(f"{task_id}: task.json says task_id {spec['task_id']!r}; it must match the folder name")

    setup_files = _files(task_dir / "repo")
    hidden_files = _files(task_dir / "hidden")
    if not setup_files or not hidden_files:
        raise TaskSourceError(f"{task_id}: repo/ and hidden/ must both hold files")

    prompt = spec["prompt"]
    fields = prompt.get("fields", {})
    for message in prompt["messages"]:
        _check_placeholders(task_id, message["content"], fields)

    evaluation = spec["evaluation"]
    if set(evaluation) != {"reward"} or evaluation["reward"] not in REWARDS:
        raise TaskSourceError(f'{task_id}: evaluation must be {{"reward": one of {REWARDS}}}')

    calls = spec["reference_solution"]
    buggy = {f.path: f.content for f in setup_files}
    fixed = _check_reference(task_id, calls, buggy)

    tools = spec.get("tools", ["bash", "editor", "submit"])
    if set(tools) - set(TOOLS):
        raise TaskSourceError(f"{task_id}: unknown tools {sorted(set(tools) - set(TOOLS))}")

    eval_files = _sealed(task_id, hidden_files)
    task = rollout_pb2.Task(
        task_id=task_id,
        setup=rollout_pb2.TaskSetup(files=setup_files),
        prompt=rollout_pb2.TaskPrompt(
            messages=[rollout_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt["messages"]],
            fields=fields,
        ),
        tools=tools,
        evaluation=rollout_pb2.TaskEvaluation(files=eval_files, commands=[EVAL_COMMAND]),
        reference_solution=[
            rollout_pb2.ToolCall(name=c["name"], arguments_json=json.dumps(c.get("arguments", {}), ensure_ascii=False))
            for c in calls
        ],
        metadata=spec.get("metadata", {}),
    )
    json_format.ParseDict(spec.get("limits", {}), task.limits)
    rule = task.evaluation.expected_observations
    rule.expected.update(_expected(task_id, buggy, fixed, eval_files))
    rule.partial_credit = evaluation["reward"] == "share_of_tests"
    return task


def task_line(task: rollout_pb2.Task) -> str:
    """One JSONL line: the proto3 JSON mapping with proto field names, maps sorted by key."""
    data = json_format.MessageToDict(task, preserving_proto_field_name=True)
    if "metadata" in data:
        data["metadata"] = dict(sorted(data["metadata"].items()))
    if "fields" in data.get("prompt", {}):
        data["prompt"]["fields"] = dict(sorted(data["prompt"]["fields"].items()))
    if "expected_observations" in data.get("evaluation", {}):
        rule = data["evaluation"]["expected_observations"]
        rule["expected"] = dict(sorted(rule["expected"].items()))
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def load_tasks(src_dir: Path = SRC_DIR) -> list[rollout_pb2.Task]:
    """Every task under src_dir, sorted by task_id."""
    tasks = [load_task(d) for d in sorted(src_dir.iterdir()) if (d / "task.json").is_file()]
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise TaskSourceError("duplicate task ids")
    return sorted(tasks, key=lambda t: t.task_id)


def render(src_dir: Path = SRC_DIR) -> str:
    """The JSONL text the sources give."""
    return "".join(task_line(task) + "\n" for task in load_tasks(src_dir))


def in_sync(src_dir: Path = SRC_DIR, out_path: Path = OUT_PATH) -> bool:
    """Whether out_path holds exactly what render(src_dir) gives."""
    return out_path.is_file() and out_path.read_text(encoding="utf-8") == render(src_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSONL is stale, writing nothing")
    parser.add_argument("--src", type=Path, default=SRC_DIR, help="task sources (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=OUT_PATH, help="output JSONL (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        text = render(args.src)
    except TaskSourceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    count = text.count("\n")
    if args.check:
        if args.out.is_file() and args.out.read_text(encoding="utf-8") == text:
            print(f"{args.out}: up to date ({count} tasks)")
            return 0
        print(f"{args.out}: stale; run python scripts/build_example_tasks.py", file=sys.stderr)
        return 1
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {count} tasks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
