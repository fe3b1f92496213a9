"""A SWE-bench-style image end to end, on every backend case: the image of
scripts/build_swe_test_image.sh (a repository at /testbed owned by root, pytest, a virtual
environment activated from /root/.bashrc) and its instance record, examples/swe/instances.jsonl.

- The image and the record agree (checked with the engine directly, as root, outside corral):
  FAIL_TO_PASS fails before the gold patch and passes after it, PASS_TO_PASS passes both times.
- The task `python -m corral.sdk.swebench` makes of the record runs through the rollout service:
  the gold patch replayed scores 1.0, no change 0, a wrong patch 0, each evaluated in a clean
  sandbox of the image with the agent's change to /testbed.
- In a sandbox of the image the agent is root with a writable root filesystem: `whoami` is root,
  /usr, /testbed and the environment can be written (`git apply`, `pip install` of a local wheel),
  and none of it reaches the image or another sandbox.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import subprocess
import zipfile
from pathlib import Path

import pytest

from corral.rollout.evaluation import EVAL_ENV, junit_reward
from corral.sdk import AsyncClient
from corral.sdk.swebench import instance_to_task
from corral.v1 import rollout_pb2 as pb
from tests.conftest import SWE_DOCKER_IMAGE, SWE_ROOTFS_IMAGE, require_backend, require_image
from tests.rollout_tasks import call, registered_replay_server

INSTANCE = json.loads((Path(__file__).parents[2] / "examples" / "swe" / "instances.jsonl").read_text())
FAIL_TO_PASS = json.loads(INSTANCE["FAIL_TO_PASS"])
PASS_TO_PASS = json.loads(INSTANCE["PASS_TO_PASS"])
# The image's environment, as /root/.bashrc activates it (evaluation names it: it reads no rc file).
ACTIVATE = ". /opt/venv/bin/activate"
# Collapses runs of separators but keeps a dash at either end: FAIL_TO_PASS still fails.
WRONG_PATCH = INSTANCE["patch"].replace(
    '+    return "-".join(re.findall(r"[a-z0-9]+", text.lower()))',
    '+    return re.sub(r"[^a-z0-9]+", "-", text.lower())',
)
# What pytest -rA prints per test.
OUTCOME_LINE = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)", re.MULTILINE)


@pytest.fixture
async def aclient(daemon):
    async with AsyncClient(daemon.address) as client:
        yield client


def test_the_image_and_its_record_agree() -> None:
    """Run as root in the engine, outside corral: the record's base commit is the image's, the
    tests it names fail and pass as it says, and /root/.bashrc activates the environment."""
    require_backend("docker")
    require_image("docker", docker_image=SWE_DOCKER_IMAGE)
    script = f"""
set -e
cd /testbed
stat -c 'owner %U' /testbed /testbed/textkit/slug.py
echo "head $(git rev-parse HEAD)"
echo "bashrc python $(bash -c '. /root/.bashrc && command -v python')"
printf %s "$TEST_PATCH" >/tmp/test.patch
printf %s "$GOLD_PATCH" >/tmp/gold.patch
git apply /tmp/test.patch
{ACTIVATE}
echo '--- before'
python -m pytest -q -rA -p no:cacheprovider || true
git apply /tmp/gold.patch
echo '--- after'
python -m pytest -q -rA -p no:cacheprovider || true
"""
    done = subprocess.run(
        ["docker", "run", "--rm", "-e", "TEST_PATCH", "-e", "GOLD_PATCH", SWE_DOCKER_IMAGE, "bash", "-c", script],
        env={**os.environ, "TEST_PATCH": INSTANCE["test_patch"], "GOLD_PATCH": INSTANCE["patch"]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    head, _, tests = done.stdout.partition("\n--- before\n")
    before, _, after = tests.partition("\n--- after\n")
    assert head.count("owner root") == 2
    assert f"head {INSTANCE['base_commit']}" in head
    assert "bashrc python /opt/venv/bin/python" in head
    outcomes_before = {test: outcome for outcome, test in OUTCOME_LINE.findall(before)}
    outcomes_after = {test: outcome for outcome, test in OUTCOME_LINE.findall(after)}
    assert outcomes_before == {**dict.fromkeys(FAIL_TO_PASS, "FAILED"), **dict.fromkeys(PASS_TO_PASS, "PASSED")}
    assert outcomes_after == dict.fromkeys(FAIL_TO_PASS + PASS_TO_PASS, "PASSED")
    # The exported root filesystem (local backend, Apptainer) holds the same commit.
    require_image("local", local_image=SWE_ROOTFS_IMAGE)
    rootfs_head = subprocess.run(
        [
            "git",
            "-c",
            f"safe.directory={SWE_ROOTFS_IMAGE}/testbed",
            "-C",
            f"{SWE_ROOTFS_IMAGE}/testbed",
            "rev-parse",
            "HEAD",
        ],
        capture_output=True,
        text=True,
    )
    assert rootfs_head.stdout.strip() == INSTANCE["base_commit"], rootfs_head.stderr


@pytest.mark.parametrize(("patch", "reward"), [("gold", 1.0), ("empty", 0.0), ("wrong", 0.0)])
def test_the_converted_tasks_evaluation_judges_the_image_as_swe_bench_does(patch: str, reward: float) -> None:
    """The task's evaluation commands and reward rule, run as root in the engine outside corral,
    with the evaluation's environment: resolved (every named test passes) is 1.0, anything else 0."""
    require_backend("docker")
    require_image("docker", docker_image=SWE_DOCKER_IMAGE)
    task = instance_to_task(INSTANCE, activate=ACTIVATE)
    (test_patch,) = task.evaluation.files
    script = "\n".join(
        [
            "set -e",
            'printf %s "$AGENT_PATCH" >/tmp/agent.patch && cd /testbed && git apply --allow-empty /tmp/agent.patch',
            f'mkdir -p {os.path.dirname(test_patch.path)} && printf %s "$TEST_PATCH" >{test_patch.path}',
            "mkdir -m 700 $HOME",
            *(f"(cd / && {command})" for command in task.evaluation.commands),
            f"cat {task.evaluation.junit.report_path}",
        ]
    )
    env = {**EVAL_ENV, "HOME": "/tmp/eval-home", "TEST_PATCH": test_patch.content.decode()}
    env["AGENT_PATCH"] = {"gold": INSTANCE["patch"], "empty": "", "wrong": WRONG_PATCH}[patch]
    done = subprocess.run(
        ["docker", "run", "--rm", *(f"-e{name}" for name in env), SWE_DOCKER_IMAGE, "bash", "-c", script],
        env={**os.environ, **env},
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    report = done.stdout[done.stdout.index(b"<?xml") :]
    assert task.evaluation.junit.all_must_pass
    assert junit_reward(report, task.evaluation.junit.tests, all_must_pass=True) == reward
    # Partial credit, for comparison: the fraction of the six tests that pass.
    partial = junit_reward(report, task.evaluation.junit.tests)
    assert partial == {"gold": 1.0, "empty": 4 / 6, "wrong": 5 / 6}[patch]


def swe_task(backend: str, image: str, name: str, solution: list[pb.ToolCall] | None = None) -> pb.Task:
    """The converter's task for the record on `backend`, under its own id (the replay policy tells
    tasks apart by their prompt), playing `solution` (None: the gold patch)."""
    task = instance_to_task(INSTANCE, backend=backend, image_map=image, activate=ACTIVATE, max_turns=8)
    task.task_id = f"{task.task_id} / {name}"
    task.prompt.messages[-1].content = f"[{task.task_id}] " + task.prompt.messages[-1].content
    if solution is not None:
        del task.reference_solution[:]
        task.reference_solution.extend(solution)
    return task


async def test_the_converted_task_scores_the_gold_patch_1_and_no_or_a_wrong_patch_0(aclient, daemon, swe_image) -> None:
    tasks = [
        swe_task(daemon.backend, swe_image, "gold"),
        swe_task(daemon.backend, swe_image, "empty", [call("submit")]),
        swe_task(
            daemon.backend,
            swe_image,
            "wrong",
            [
                call("editor", command="create", path="/tmp/wrong.patch", file_text=WRONG_PATCH),
                call("bash", command="cd /testbed && git apply /tmp/wrong.patch"),
                call("submit"),
            ],
        ),
    ]
    async with registered_replay_server(aclient, tasks):
        results = {r.task_id.rsplit(" / ", 1)[1]: r async for r in aclient.rollouts.stream(tasks)}
    # For a failure: the status, reward, error, what the tools answered and the evaluation's output.
    outcome = {
        name: f"{r.status} reward {r.reward} {r.error}\n"
        + "".join(f"[{m['role']}] {m['content'][-400:]}\n" for m in r.messages[2:])
        + f"[eval]\n{r.eval_output[-1500:].decode()}"
        for name, r in results.items()
    }
    assert all(r.status == "completed" for r in results.values()), "\n".join(outcome.values())
    assert results["gold"].reward == 1.0, outcome["gold"]
    # Left alone, FAIL_TO_PASS fails; the wrong patch passes 5 of the 6 tests: neither is resolved.
    assert results["empty"].reward == 0.0, outcome["empty"]
    assert "2 failed, 4 passed" in outcome["empty"], outcome["empty"]
    assert results["wrong"].reward == 0.0, outcome["wrong"]
    assert "1 failed, 5 passed" in outcome["wrong"], outcome["wrong"]
    # In a clean sandbox (a fork of the set-up sandbox's snapshot, or a new one), with the patch
    # carried as the agent's change.
    assert all(r.eval_sandbox in ("snapshot_fork", "new") for r in results.values()), outcome
    assert "the agent's change: 1 files written" in outcome["gold"], outcome["gold"]


def local_wheel() -> tuple[str, bytes]:
    """A pure-Python wheel built here, offline, with the standard library: its file name and bytes."""
    files = {
        "corral_swe_probe/__init__.py": b'GREETING = "hello from a local wheel"\n',
        "corral_swe_probe-0.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: corral-swe-probe\nVersion: 0.1\n",
        "corral_swe_probe-0.1.dist-info/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: corral-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files["corral_swe_probe-0.1.dist-info/RECORD"] = (
        "\n".join([*record, "corral_swe_probe-0.1.dist-info/RECORD,,"]) + "\n"
    ).encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return "corral_swe_probe-0.1-py3-none-any.whl", buffer.getvalue()


def image_fingerprint(image: str) -> str:
    """What a sandbox could change in the image: for a root filesystem directory, the path, mode
    and content of every file under /testbed, /opt/venv and /usr/local and whether /usr/x exists;
    for an engine image, its id."""
    if not image.startswith("/"):
        return subprocess.run(
            ["docker", "image", "inspect", "-f", "{{.Id}}", image], capture_output=True, text=True, check=True
        ).stdout
    digest = hashlib.sha256(str(os.path.lexists(f"{image}/usr/x")).encode())
    for top in ("testbed", "opt/venv", "usr/local"):
        for directory, dirs, names in sorted(os.walk(f"{image}/{top}")):
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(directory, name)
                info = os.lstat(path)
                digest.update(f"{path}\0{info.st_mode}\0".encode())
                if os.path.isfile(path) and not os.path.islink(path):
                    digest.update(Path(path).read_bytes())
    return digest.hexdigest()


async def test_the_agent_is_root_with_a_writable_root_filesystem(aclient, daemon, swe_image) -> None:
    before = image_fingerprint(swe_image)
    wheel_name, wheel = local_wheel()
    async with aclient.create_sandbox(image=swe_image, backend=daemon.backend) as sandbox:
        whoami = await sandbox.exec("whoami")
        assert whoami.stdout.decode().strip() == "root", whoami
        touch = await sandbox.exec("touch /usr/x && echo ok")
        assert touch.stdout == b"ok\n", touch
        await sandbox.write_file("/tmp/gold.patch", INSTANCE["patch"].encode())
        applied = await sandbox.exec("cd /testbed && git apply /tmp/gold.patch && git status --porcelain")
        assert applied.ok and applied.stdout == b" M textkit/slug.py\n", applied
        # The agent's own edits: through the file calls (the editor tool) and the shell.
        await sandbox.write_file("/testbed/NOTES.md", b"notes\n")
        edited = await sandbox.exec("echo '# edited' >>/testbed/README.md && cat /testbed/NOTES.md")
        assert edited.stdout == b"notes\n", edited
        await sandbox.write_file(f"/tmp/{wheel_name}", wheel)
        installed = await sandbox.exec(
            f". /root/.bashrc && pip install -q --no-index /tmp/{wheel_name} "
            "&& python -c 'import corral_swe_probe; print(corral_swe_probe.GREETING)'"
        )
        assert installed.stdout.decode().splitlines()[-1:] == ["hello from a local wheel"], installed
    # None of it reached the image, nor a new sandbox of it.
    assert image_fingerprint(swe_image) == before
    async with aclient.create_sandbox(image=swe_image, backend=daemon.backend) as sandbox:
        fresh = await sandbox.exec(
            "test ! -e /usr/x && git -C /testbed status --porcelain && "
            "! /opt/venv/bin/python -c 'import corral_swe_probe' 2>/dev/null && echo clean"
        )
        assert fresh.stdout.decode().splitlines()[-1:] == ["clean"], fresh
