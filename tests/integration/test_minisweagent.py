"""corral.integrations.minisweagent against the real mini-swe-agent package: mini's environment
contract as its own tests state it (tests/environments/test_docker.py, test_local.py and
test_singularity.py of mini-swe-agent 2.4.6, restated here against CorralEnvironment), mini's
DefaultAgent driven by its DeterministicModel (its tests/agents/test_default.py), a whole episode
fixing a bug, and the `mini` command reading the environment from YAML by class path, on the local
and docker backends, in one-exec-per-action and persistent-shell modes.

With CORRAL_MINISWEAGENT_TESTS pointing at a checkout of mini-swe-agent, its own test modules also
run unchanged against corral (minisweagent_plugin.py and README-harness-tests.md beside this file).
"""

from __future__ import annotations

import os

from tests.conftest import require_harness

require_harness("minisweagent", "minisweagent", "minisweagent")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")  # mini prints a banner on import otherwise

import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
import xml.etree.ElementTree as ElementTree  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest.mock import patch  # noqa: E402

import pydantic  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import builtin_config_dir  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from corral.integrations.minisweagent import HARNESS_LABEL, HARNESS_NAME, CorralEnvironment  # noqa: E402
from corral.sdk import Client, FailedPrecondition, NotFound  # noqa: E402
from tests.conftest import DOCKER_TEST_IMAGE, require_backend, require_image  # noqa: E402

CLASS_PATH = "corral.integrations.minisweagent.CorralEnvironment"
SANDBOXES = {
    "local": {"backend": "local", "image": "host"},
    "docker": {"backend": "docker", "image": DOCKER_TEST_IMAGE},
}
MODES = {"exec": False, "shell": True}
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

MakeEnv = Callable[..., CorralEnvironment]


@pytest.fixture(params=list(SANDBOXES))
def backend(request) -> str:
    require_backend(request.param)
    require_image(request.param)
    return request.param


@pytest.fixture(params=list(MODES))
def mode(request) -> str:
    return request.param


@pytest.fixture
def make_env(local_daemon, backend, mode) -> Iterator[MakeEnv]:
    """Builds CorralEnvironments on the case's backend and mode, as mini's tests build theirs;
    each is cleaned up after the test."""
    made: list[CorralEnvironment] = []

    def make(**options) -> CorralEnvironment:
        options = {"address": local_daemon.address, "persistent_shell": MODES[mode], **SANDBOXES[backend], **options}
        env = CorralEnvironment(**options)
        made.append(env)
        return env

    yield make
    for env in made:
        env.cleanup()


@pytest.fixture
def make_exec_env(local_daemon, backend) -> Iterator[MakeEnv]:
    """make_env in the default mode (one exec per action) only."""
    made: list[CorralEnvironment] = []

    def make(**options) -> CorralEnvironment:
        env = CorralEnvironment(address=local_daemon.address, **{**SANDBOXES[backend], **options})
        made.append(env)
        return env

    yield make
    for env in made:
        env.cleanup()


@pytest.fixture(scope="module")
def shared_envs() -> Iterator[dict[tuple[str, str, str], CorralEnvironment]]:
    """The module's shared environments, by backend, mode and options; destroyed after the module."""
    envs: dict[tuple[str, str, str], CorralEnvironment] = {}
    yield envs
    for env in envs.values():
        env.cleanup()


def shared(envs: dict, address: str, backend: str, mode: str, options: dict) -> CorralEnvironment:
    key = (backend, mode, json.dumps(options, sort_keys=True))
    if key not in envs:
        options = {"address": address, "persistent_shell": MODES[mode], **SANDBOXES[backend], **options}
        envs[key] = CorralEnvironment(**options)
    return envs[key]


@pytest.fixture
def shared_env(shared_envs, local_daemon, backend, mode) -> MakeEnv:
    """An environment with these options on the case's backend and mode, made by the first test
    that asks and shared with the next ones (a sandbox costs a second or two to make and destroy).
    For tests that leave nothing another test reads: no `cd`, exported variable or cwd argument
    (in shell mode they outlive the action), files under names of their own."""
    return lambda **options: shared(shared_envs, local_daemon.address, backend, mode, options)


@pytest.fixture
def shared_exec_env(shared_envs, local_daemon, backend) -> MakeEnv:
    """shared_env in the default mode (one exec per action) only."""
    return lambda **options: shared(shared_envs, local_daemon.address, backend, "exec", options)


# mini's environment tests (test_docker.py, test_local.py, test_singularity.py), restated.


def test_basic_execution(shared_env):
    result = shared_env().execute({"command": "echo 'hello world'"})
    assert result == {"output": "hello world\n", "returncode": 0, "exception_info": ""}


def test_env_and_forward_env(make_env):
    """`env` is set, `forward_env` passes on the host's variables that are set (an unset one stays
    unset), and `env` wins over a forwarded variable of the same name."""
    os.environ.pop("CORRAL_TEST_NONEXISTENT_VAR", None)
    host = {"HOST_VAR": "host_value", "ANOTHER_HOST_VAR": "another_host_value", "CONFLICT_VAR": "from_host"}
    with patch.dict(os.environ, host):
        env = make_env(
            env={"TEST_VAR": "test_value", "ANOTHER_VAR": "another_value", "CONFLICT_VAR": "from_config"},
            forward_env=["HOST_VAR", "ANOTHER_HOST_VAR", "CONFLICT_VAR", "CORRAL_TEST_NONEXISTENT_VAR"],
        )
        result = env.execute(
            {
                "command": "echo $TEST_VAR $ANOTHER_VAR; echo $HOST_VAR $ANOTHER_HOST_VAR; echo $CONFLICT_VAR; "
                'echo "[${CORRAL_TEST_NONEXISTENT_VAR-unset}]"'
            }
        )
    assert result["output"] == "test_value another_value\nhost_value another_host_value\nfrom_config\n[unset]\n"


def test_custom_cwd_and_cwd_parameter_override(make_env):
    env = make_env(cwd="/tmp")
    assert env.execute({"command": "pwd"})["output"] == "/tmp\n"
    assert env.execute({"command": "pwd"}, cwd="/")["output"] == "/\n"


def test_default_cwd_is_the_sandbox_workdir(shared_env):
    env = shared_env()
    assert env.execute({"command": "pwd"})["output"] == f"{env.sandbox.info.workdir}\n"


def test_return_codes_and_a_nonexistent_command(shared_env):
    env = shared_env()
    for command, returncode in [("echo test", 0), ("exit 1", 1), ("exit 42", 42)]:
        assert env.execute({"command": command})["returncode"] == returncode, command
    result = env.execute({"command": "nonexistent_command_12345"})
    assert result["returncode"] == 127
    assert "nonexistent_command_12345" in result["output"]


def test_stdout_and_stderr_merged_in_the_order_written(shared_env):
    result = shared_env().execute({"command": "echo one; echo two >&2; echo three; echo four >&2"})
    assert result["output"] == "one\ntwo\nthree\nfour\n"


def test_multiline_output_pipes_and_substitution(shared_env):
    env = shared_env()
    assert env.execute({"command": "printf 'line1\\nline2\\nline3\\n'"})["output"].splitlines() == [
        "line1",
        "line2",
        "line3",
    ]
    assert env.execute({"command": "echo 'hello world' | grep world"})["output"] == "hello world\n"
    assert env.execute({"command": "echo $(echo nested)"})["output"] == "nested\n"


def test_file_operations_in_the_workdir(shared_env):
    env = shared_env()
    assert env.execute({"command": "echo 'test content' > test.txt"})["returncode"] == 0
    assert env.execute({"command": "cat test.txt"})["output"] == "test content\n"
    # mini's test reads the file from the host; here it is the sandbox's own.
    assert env.sandbox.read_file("test.txt") == b"test content\n"


# The config's timeout of the timeout tests: long enough for a loaded machine to start the action
# and let it write its first output (a `docker exec` under load takes most of a second).
TIMEOUT = 2


def test_timeout_gives_mini_timeout_shape_with_partial_output_and_kills_the_action_s_children(shared_env):
    env = shared_env(timeout=TIMEOUT)
    result = env.execute({"command": "echo $((111*9)); (sleep 300 & echo $! > /tmp/child.pid; wait)"})
    assert result["returncode"] == -1
    assert result["output"] == "999\n"
    assert f"timed out after {TIMEOUT} seconds" in result["exception_info"]
    assert result["exception_info"].startswith("An error occurred while executing the command: ")
    assert result["extra"]["exception_type"] == "TimeoutExpired"
    # The environment goes on after a timeout (in shell mode: the same session), and the action's
    # whole process tree is gone, its subshell's child included.
    child = env.execute({"command": "cat /tmp/child.pid"})["output"].strip()
    assert child.isdigit()
    deadline = time.monotonic() + 10
    while env.execute({"command": f"kill -0 {child}"})["returncode"] == 0:
        assert time.monotonic() < deadline, f"the timed-out action's child {child} is still running"
        time.sleep(0.2)


def test_timeout_argument_overrides_the_config(shared_env):
    result = shared_env().execute({"command": "sleep 10"}, timeout=1)
    assert result["returncode"] == -1 and "timed out after 1 seconds" in result["exception_info"]


def test_submitted_raised_on_the_marker_with_exit_0(shared_env):
    env = shared_env()
    with pytest.raises(Submitted) as raised:
        env.execute({"command": f"{SUBMIT}; echo 'the diff'"})
    (message,) = raised.value.messages
    assert message == {
        "role": "exit",
        "content": "the diff\n",
        "extra": {"exit_status": "Submitted", "submission": "the diff\n"},
    }
    # Not on a failing command, nor when the marker is not the first line.
    assert env.execute({"command": f"{SUBMIT}; exit 3"})["returncode"] == 3
    assert env.execute({"command": f"echo first; {SUBMIT}"})["returncode"] == 0


def test_writable_tmp_and_root_filesystem(shared_env):
    env = shared_env()
    result = env.execute({"command": "echo 'test content' > /tmp/test_file.txt && cat /tmp/test_file.txt"})
    assert result["output"] == "test content\n"
    result = env.execute({"command": "touch /usr/testfile && ls /usr/testfile"})
    assert result["returncode"] == 0
    assert "/usr/testfile" in result["output"]


# What the integration adds: mini's template variables and serialization, errors, persistent shells.


def test_template_vars_and_serialize(make_exec_env):
    env = make_exec_env(cwd="/tmp", timeout=7)
    tvars = env.get_template_vars(extra_var=1)
    assert tvars["cwd"] == "/tmp" and tvars["timeout"] == 7 and tvars["extra_var"] == 1
    assert {"system", "release", "machine"} <= tvars.keys()  # mini's default templates use them
    info = env.serialize()["info"]["config"]
    assert info["environment_type"] == CLASS_PATH
    assert info["environment"]["cwd"] == "/tmp"
    json.dumps(env.serialize())  # a saved trajectory is JSON


def test_failed_call_gives_mini_exception_shape(shared_exec_env):
    result = shared_exec_env().execute({"command": "pwd"}, cwd="/no/such/dir")
    assert result["returncode"] == -1
    assert "/no/such/dir" in result["exception_info"]
    assert result["extra"]["exception_type"] == "FailedPrecondition"


def test_unknown_option_is_refused(local_daemon):
    with pytest.raises(pydantic.ValidationError, match="forwrd_env"):
        CorralEnvironment(address=local_daemon.address, forwrd_env=["HOME"])


def test_long_output_is_truncated_and_says_so(make_exec_env):
    result = make_exec_env(output_limit=1000).execute({"command": "head -c 100000 /dev/zero | tr '\\0' x"})
    assert result["returncode"] == 0
    assert len(result["output"]) <= 1000
    assert result["extra"] == {"truncated": True, "output_total_bytes": 100000}


def test_exec_mode_runs_each_action_in_a_fresh_shell(shared_exec_env):
    env = shared_exec_env()
    env.execute({"command": "cd /tmp; export KEPT=yes"})
    assert env.execute({"command": "pwd; echo ${KEPT-no}"})["output"] == f"{env.sandbox.info.workdir}\nno\n"


def test_persistent_shell_keeps_cwd_and_variables(local_daemon, backend):
    with CorralEnvironment(address=local_daemon.address, persistent_shell=True, **SANDBOXES[backend]) as env:
        env.execute({"command": "cd /tmp; export KEPT=yes"})
        assert env.execute({"command": "pwd; echo $KEPT"})["output"] == "/tmp\nyes\n"
        # A cwd argument moves the session there, as a `cd` would.
        assert env.execute({"command": "pwd"}, cwd="/")["output"] == "/\n"
        assert env.execute({"command": "pwd"})["output"] == "/\n"


def test_persistent_shell_in_a_missing_directory_names_it(local_daemon, backend):
    with pytest.raises(FailedPrecondition, match="cwd /no/such/dir does not exist"):
        CorralEnvironment(address=local_daemon.address, persistent_shell=True, cwd="/no/such/dir", **SANDBOXES[backend])


# The safety net: labels, explicit cleanup, collection, and the idle timeout after a crash.


def test_sandbox_labelled_and_destroyed_by_cleanup(local_daemon):
    with Client(local_daemon.address) as client:
        env = CorralEnvironment(address=local_daemon.address, image="host", labels={"run": "t1"}, idle_timeout=120)
        sandbox_id = env.sandbox.id
        listed = {s.id: s for s in client.list_sandboxes(labels={HARNESS_LABEL: HARNESS_NAME, "run": "t1"})}
        assert sandbox_id in listed
        assert listed[sandbox_id].idle_timeout == 120
        env.cleanup()
        env.cleanup()  # a second call does nothing
        with pytest.raises(NotFound):
            client.get_sandbox(sandbox_id)


@pytest.mark.parametrize("persistent_shell", [False, True])
def test_attached_environment_runs_in_the_given_sandbox_and_leaves_it_to_its_owner(local_daemon, persistent_shell):
    with Client(local_daemon.address) as client:
        owned = client.create_sandbox(image="host")
        try:
            env = CorralEnvironment(
                address=local_daemon.address, sandbox_id=owned.id, persistent_shell=persistent_shell
            )
            assert env.execute({"command": "echo hi > mark; pwd"})["output"] == f"{owned.info.workdir}\n"
            assert owned.read_file("mark") == b"hi\n"
            assert HARNESS_LABEL not in client.get_sandbox(owned.id).info.labels  # not relabelled
            env.cleanup()
            env.cleanup()
            assert client.get_sandbox(owned.id).info.id == owned.id  # still there
            assert not [s for s in owned.list_shells() if s.name == "mini-swe-agent"]  # its shell is closed
        finally:
            owned.destroy()


def test_attaching_refuses_options_that_shape_a_new_sandbox_and_unknown_ids(local_daemon):
    with pytest.raises(pydantic.ValidationError, match="image, memory_bytes cannot apply"):
        CorralEnvironment(address=local_daemon.address, sandbox_id="sb-x", image="host", memory_bytes=1 << 30)
    with pytest.raises(NotFound):
        CorralEnvironment(address=local_daemon.address, sandbox_id="sb-does-not-exist")


def test_sandbox_destroyed_when_the_environment_is_collected(local_daemon):
    with Client(local_daemon.address) as client:
        env = CorralEnvironment(address=local_daemon.address, image="host")
        sandbox_id = env.sandbox.id
        del env
        gc.collect()
        with pytest.raises(NotFound):
            client.get_sandbox(sandbox_id)


def test_killed_harness_leaks_no_sandbox(local_daemon):
    """A harness killed with SIGKILL runs no cleanup at all: the idle timeout destroys its sandbox."""
    harness = textwrap.dedent(
        f"""
        import os, signal
        from corral.integrations.minisweagent import CorralEnvironment
        env = CorralEnvironment(address={local_daemon.address!r}, image="host", idle_timeout=2)
        env.execute({{"command": "true"}})
        print(env.sandbox.id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", harness],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "MSWEA_SILENT_STARTUP": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    sandbox_id = proc.stdout.strip()
    with Client(local_daemon.address) as client:
        deadline = time.monotonic() + 30
        # Listing does not count as use of the sandbox (a get would restart its idle clock).
        while sandbox_id in {s.id for s in client.list_sandboxes(labels={HARNESS_LABEL: HARNESS_NAME})}:
            assert time.monotonic() < deadline, f"sandbox {sandbox_id} outlived its idle timeout"
            time.sleep(0.5)


# mini's DefaultAgent with its DeterministicModel (tests/agents/test_default.py), restated.


def default_agent(env: CorralEnvironment, steps: list[tuple[str, str]], **config) -> DefaultAgent:
    agent_config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())["agent"]
    model = DeterministicModel(outputs=[make_output(thought, [{"command": command}]) for thought, command in steps])
    return DefaultAgent(model=model, env=env, **{**agent_config, **config})


def observations(agent: DefaultAgent) -> list[str]:
    return [m["content"] for m in agent.messages[3::2] if m["role"] == "user"]


def test_agent_runs_to_submission(shared_env):
    agent = default_agent(
        shared_env(),
        [
            ("Step 1", "echo first"),
            ("Step 2", "echo second >&2"),
            ("Finish", f"{SUBMIT}\necho 'completed all steps'"),
        ],
        cost_limit=5.0,
    )
    info = agent.run("Multi-step task")
    assert info["exit_status"] == "Submitted"
    assert info["submission"] == "completed all steps\n"
    assert agent.n_calls == 3
    seen = observations(agent)
    assert len(seen) == 2 and "first" in seen[0] and "second" in seen[1]
    assert "<returncode>0</returncode>" in seen[0]


def test_agent_recovers_from_a_timeout_with_partial_output(shared_env):
    agent = default_agent(
        shared_env(timeout=TIMEOUT),
        [("Output then sleep", "echo $((111*9)); sleep 10"), ("Finish", f"{SUBMIT}\necho recovered")],
    )
    info = agent.run("Test timeout with partial output")
    assert info["exit_status"] == "Submitted"
    assert info["submission"] == "recovered\n"
    (timed_out,) = [text for text in observations(agent) if "timed out" in text]
    assert "999" in timed_out and "<returncode>-1</returncode>" in timed_out


def test_agent_saves_the_environment_in_its_trajectory(shared_exec_env, tmp_path):
    agent = default_agent(shared_exec_env(), [("Finish", f"{SUBMIT}\necho done")], output_path=tmp_path / "t.json")
    agent.run("Save")
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["info"]["config"]["environment_type"] == CLASS_PATH
    assert saved["info"]["submission"] == "done\n"


# A whole episode: a repository with a bug and a failing test, fixed by the scripted agent.

BUGGY_REPO = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "test_calc.py": textwrap.dedent(
        """\
        import unittest

        from calc import add


        class AddTest(unittest.TestCase):
            def test_add(self):
                self.assertEqual(add(2, 3), 5)


        if __name__ == "__main__":
            unittest.main()
        """
    ),
}
# -B: no bytecode cache, whose timestamp check (to the second, and the size) would miss a fix
# made in the same second as the failing run that wrote it.
RUN_TESTS = "python3 -B -m unittest -q test_calc"
# mini's default.yaml asks for the submission this way.
SUBMIT_DIFF = f"{SUBMIT} && git add -A && git diff --cached"


def run_tests_in(repo: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-B", "-m", "unittest", "-q", "test_calc"], cwd=repo, capture_output=True)


def test_default_agent_fixes_a_bug_and_submits_the_diff(make_exec_env, tmp_path):
    """mini's DefaultAgent with its default config and a scripted DeterministicModel: the task's
    test fails in the sandbox, the agent fixes the bug, the test passes, and the diff it submits
    fixes a fresh copy of the repository outside the sandbox."""
    env = make_exec_env(cwd="repo")
    for name, text in BUGGY_REPO.items():
        env.sandbox.write_file(f"repo/{name}", text)
    setup = "git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm buggy"
    env.sandbox.exec(["sh", "-c", setup], cwd="repo", check=True)
    agent = default_agent(
        env,
        [
            ("Run the tests", RUN_TESTS),
            ("Fix add()", "sed -i 's/return a - b/return a + b/' calc.py"),
            ("Run them again", RUN_TESTS),
            ("Submit", SUBMIT_DIFF),
        ],
        cost_limit=10.0,
    )
    info = agent.run("add(2, 3) returns -1; make test_calc pass")
    assert info["exit_status"] == "Submitted"
    before, _, after = observations(agent)
    assert "<returncode>1</returncode>" in before and "FAILED" in before
    assert "<returncode>0</returncode>" in after and "OK" in after
    diff = info["submission"]
    # The fix, and only the fix: the test is as it was.
    assert [line for line in diff.splitlines() if line.startswith("diff ")] == ["diff --git a/calc.py b/calc.py"]
    assert "-    return a - b\n+    return a + b\n" in diff
    # The submitted diff fixes the buggy repository where it was not made.
    repo = tmp_path / "repo"
    repo.mkdir()
    for name, text in BUGGY_REPO.items():
        (repo / name).write_text(text)
    assert run_tests_in(repo).returncode == 1
    subprocess.run(["git", "apply", "-"], input=diff.encode(), cwd=repo, check=True)
    assert run_tests_in(repo).returncode == 0


# mini's own entry points: get_environment by class path, and the `mini` command with a YAML config.


def test_get_environment_by_class_path(local_daemon):
    env = get_environment({"environment_class": CLASS_PATH, "address": local_daemon.address, "image": "host"})
    try:
        assert isinstance(env, CorralEnvironment)
        assert env.execute({"command": "echo hi"})["output"] == "hi\n"
    finally:
        env.cleanup()


def test_mini_command_with_yaml_config(local_daemon, tmp_path):
    """`mini -c default.yaml -c corral.yaml`: the environment by class path from YAML, a scripted
    model fixing a file in the sandbox and submitting its diff. On the local backend only: the YAML's
    backend and image are passed on as any option is, and the episode above runs on both."""
    backend = "local"
    require_backend(backend)
    steps = [
        ("Write the buggy file", "printf 'def add(a, b):\\n    return a - b\\n' > calc.py && cp calc.py calc.py.orig"),
        ("Fix it", "sed -i 's/a - b/a + b/' calc.py && python3 -c 'import calc; assert calc.add(2, 3) == 5'"),
        ("Submit", f"{SUBMIT}\ndiff -u calc.py.orig calc.py; true"),
    ]
    config = {
        "environment": {"environment_class": CLASS_PATH, "address": local_daemon.address, **SANDBOXES[backend]},
        "model": {
            "model_name": "deterministic",
            "outputs": [make_output(thought, [{"command": command}]) for thought, command in steps],
        },
        "agent": {"agent_class": "default", "cost_limit": 10.0},
    }
    (tmp_path / "corral.yaml").write_text(yaml.safe_dump(config))
    trajectory = tmp_path / "trajectory.json"
    run = subprocess.run(
        [sys.executable, "-m", "minisweagent.run.mini", "-c", "default.yaml", "-c", str(tmp_path / "corral.yaml")]
        + ["--model-class", "deterministic", "-t", "Fix add()", "-y", "--exit-immediately", "-o", str(trajectory)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "MSWEA_SILENT_STARTUP": "1", "MSWEA_CONFIGURED": "true"},
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    info = json.loads(trajectory.read_text())["info"]
    assert info["exit_status"] == "Submitted"
    assert "-    return a - b\n+    return a + b\n" in info["submission"]
    assert info["config"]["environment_type"] == CLASS_PATH


# mini-swe-agent's own test modules, unchanged, when a checkout of it is at hand (its releases on
# PyPI carry no tests: see README-harness-tests.md beside this file).

MINI_TESTS = os.environ.get("CORRAL_MINISWEAGENT_TESTS", "")
MINI_ENVIRONMENT_MODULES = ("tests/environments/test_docker.py", "tests/environments/test_local.py")
# The agent's tests make an environment each (48 of them) and are about the agent, not the sandbox:
# on the local backend only, where a sandbox is cheaper than a container.
MINI_AGENT_MODULES = ("tests/agents/test_default.py",)


@pytest.mark.skipif(not MINI_TESTS, reason="CORRAL_MINISWEAGENT_TESTS (a checkout of mini-swe-agent) is not set")
def test_mini_swe_agent_own_test_modules(local_daemon, backend, mode, tmp_path):
    """The modules pass, but for the tests that inspect the host, which the plugin marks as strict
    expected failures (minisweagent_plugin.HOST_TESTS): a new failure fails this test."""
    report = tmp_path / "junit.xml"
    modules = MINI_ENVIRONMENT_MODULES + (MINI_AGENT_MODULES if backend == "local" else ())
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "minisweagent_plugin", "-rfxX"]
        + ["--junitxml", str(report), *modules],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=MINI_TESTS,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).parent),
            "MSWEA_SILENT_STARTUP": "1",
            "CORRAL_ADDRESS": local_daemon.address,
            "CORRAL_MINI_BACKEND": SANDBOXES[backend]["backend"],
            "CORRAL_MINI_IMAGE": SANDBOXES[backend]["image"],
            "CORRAL_MINI_SHELL": "1" if MODES[mode] else "0",
        },
    )
    cases = list(ElementTree.parse(report).iter("testcase"))
    failed = [case for case in cases if case.find("failure") is not None or case.find("error") is not None]
    skipped = [skip.get("type") for case in cases if (skip := case.find("skipped")) is not None]
    expected = skipped.count("pytest.xfail")
    print(
        f"mini-swe-agent's tests on {backend}/{mode}: {len(cases)} run, {len(cases) - len(failed) - len(skipped)} "
        f"passed, {expected} expected failures, {len(skipped) - expected} skipped, {len(failed)} failed"
    )
    assert len(cases) >= 30, run.stdout[-5000:]  # the modules were found and collected
    assert run.returncode == 0, run.stdout[-5000:]
