"""corral.integrations.swerex against the real swe-rex package, on the local and docker backends:
CorralRuntime called directly and, unchanged, through SWE-ReX's own RemoteRuntime talking to
`corral swerex-serve` (a subprocess): sessions and `check` modes, timeouts with partial output,
interrupts, interactive programs driven by expect (a python REPL), execute, files at exact paths,
is_alive, close; CorralDeployment's sandbox (labels, stop); and a whole episode on SWE-agent's path
(a scripted model fixing a bug and submitting the diff through swerex-serve).

With CORRAL_SWEREX_TESTS pointing at the tests/ directory of SWE-ReX's source distribution (or
set to "pypi": that of the installed version, downloaded with pip), its own runtime test modules
also run against corral (swerex_plugin.py beside this file).
"""

from __future__ import annotations

import os

from tests.conftest import require_harness

require_harness("swerex", "swerex", "swerex")

import asyncio  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import time  # noqa: E402
import xml.etree.ElementTree as ElementTree  # noqa: E402
from collections.abc import AsyncIterator, Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Literal  # noqa: E402

import aiohttp  # noqa: E402
import pytest  # noqa: E402
from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
)
from swerex.runtime.abstract import (  # noqa: E402
    AbstractRuntime,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

from corral.integrations.swerex import HARNESS_LABEL, HARNESS_NAME, CorralDeployment  # noqa: E402
from corral.sdk import Client  # noqa: E402
from tests.conftest import DOCKER_TEST_IMAGE, require_backend, require_image  # noqa: E402

SANDBOXES: dict[str, dict[str, Any]] = {
    "local": {"backend": "local", "image": "host"},
    "docker": {"backend": "docker", "image": DOCKER_TEST_IMAGE},
}
TOKEN = "swerex-test-token"
# SWE-ReX's own test modules (its source distribution's tests/), run by
# test_swe_rex_own_test_modules when set.
SWEREX_TESTS = os.environ.get("CORRAL_SWEREX_TESTS", "")
# Those about a runtime (the others test its LocalRuntime's helpers, its docker, modal, fargate and
# daytona deployments).
SWEREX_TEST_MODULES = ("test_execution.py", "test_server.py", "test_remote_deployment.py")
# SWE-ReX's tests that cannot pass on a sandbox, and why.
SWEREX_HOST_TESTS = {
    "test_read_write_file": "reads the file back on the host (path.read_text()) instead of in the sandbox",
    "test_read_large_file": "writes the file on the host and reads it through the runtime",
    "test_interrupt_pager": "expects `echo blargh | less -+F` to time out: a corral shell's less copies its "
    "input as cat does (PAGER=cat too), so it ends at once and no CommandTimeoutError comes",
    # Image contents: the test images (the host's /usr/bin for local, corral-test/python) have
    # python3 but no `python`.
    "test_bash_multiline_command_eof": "runs `python`, which the test images lack",
    "test_run_in_shell_interactive_command_timeout": "starts `python`, which the test images lack: it ends at "
    "once instead of running into the timeout (it passes when the 0.1 s timeout comes first)",
}
A = BashAction


@dataclass
class SwerexServer:
    """`corral swerex-serve` in a child process, serving one sandbox."""

    proc: subprocess.Popen
    url: str
    sandbox_id: str

    def runtime(self, token: str = TOKEN) -> RemoteRuntime:
        return RemoteRuntime(host=self.url, auth_token=token, timeout=10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(30)


def start_swerex_server(address: str, *options: str) -> SwerexServer:
    proc = subprocess.Popen(
        [sys.executable, "-m", "corral.cli", "--address", address, "swerex-serve", "--port", "0", *options],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "CORRAL_SWEREX_TOKEN": TOKEN},
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the first line names the sandbox and the URL; EOF if it failed
    found = re.match(r"corral swerex-serve: sandbox (\S+) on (http://\S+)", line)
    if found is None:
        proc.kill()
        pytest.fail(f"corral swerex-serve did not start (exit {proc.wait()}): {line!r}")
    return SwerexServer(proc, found.group(2), found.group(1))


@pytest.fixture(scope="module", params=list(SANDBOXES))
def backend(request) -> str:
    require_backend(request.param)
    require_image(request.param)
    return request.param


@pytest.fixture(scope="module")
def server(local_daemon, backend) -> Iterator[SwerexServer]:
    """One server per backend for the module; each test's RemoteRuntime closes its sessions."""
    server = start_swerex_server(local_daemon.address, *_sandbox_options(backend))
    yield server
    assert server.stop() == 0


@pytest.fixture(params=["corral", "remote"])
async def runtime(request, local_daemon, backend) -> AsyncIterator[AbstractRuntime]:
    """A CorralRuntime of a fresh CorralDeployment, or RemoteRuntime against swerex-serve."""
    if request.param == "remote":
        remote = request.getfixturevalue("server").runtime()
        yield remote
        await remote.close()
        return
    deployment = CorralDeployment(address=local_daemon.address, **SANDBOXES[backend])
    await deployment.start()
    yield deployment.runtime
    await deployment.stop()


@pytest.fixture
async def session(runtime) -> AsyncIterator[AbstractRuntime]:
    """`runtime` with the session "default" open."""
    await runtime.create_session(CreateBashSessionRequest())
    yield runtime


async def test_session_output_exit_codes_and_check_modes(session):
    run = session.run_in_session
    assert (await run(A(command="echo 'hello world'", check="raise"))).output == "hello world\n"
    assert (await run(A(command="printf '\\n\\nx\\n\\n\\n'", check="raise"))).output == "\n\nx\n\n\n"
    assert (await run(A(command="printf '  x'", check="raise"))).output == "  x"
    silent = await run(A(command="echo out; doesnotexist", check="silent"))
    assert silent.exit_code == 127 and silent.output.startswith("out\n")
    assert (await run(A(command="false && true", check="silent"))).exit_code == 1
    ignored = await run(A(command="echo x; false", check="ignore"))
    assert (ignored.output, ignored.exit_code) == ("x\n", None)
    with pytest.raises(NonZeroExitCodeError, match="my message: Command 'false' failed with exit code 1"):
        await run(A(command="false", check="raise", error_msg="my message"))
    heredoc = await run(A(command="python3 <<EOF\nprint('a')\nprint('b')\nEOF", check="raise"))
    assert heredoc.output == "a\nb\n"


async def test_sessions_keep_state_and_are_isolated(runtime):
    await runtime.create_session(CreateBashSessionRequest(session="one"))
    await runtime.create_session(CreateBashSessionRequest(session="two"))
    with pytest.raises(SessionExistsError):
        await runtime.create_session(CreateBashSessionRequest(session="one"))
    await asyncio.gather(
        runtime.run_in_session(A(command="cd /tmp && x=42", session="one")),
        runtime.run_in_session(A(command="y=24", session="two")),
    )
    assert (await runtime.run_in_session(A(command="echo $x $y; pwd", session="one"))).output == "42\n/tmp\n"
    assert (await runtime.run_in_session(A(command="echo $x $y", session="two"))).output == "24\n"
    await runtime.close_session(CloseBashSessionRequest(session="one"))
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(A(command="true", session="one"))
    with pytest.raises(SessionDoesNotExistError):
        await runtime.close_session(CloseBashSessionRequest(session="one"))


async def test_startup_source_runs_in_the_session(runtime):
    await runtime.write_file(WriteFileRequest(path="/tmp/swerex-rc", content="export FROM_RC=1\necho sourced\n"))
    created = await runtime.create_session(CreateBashSessionRequest(startup_source=["/tmp/swerex-rc"]))
    assert created.output == "sourced\n"
    assert (await runtime.run_in_session(A(command="echo $FROM_RC"))).output == "1\n"


async def test_syntax_error_is_refused_before_anything_runs(session):
    with pytest.raises(BashIncorrectSyntaxError) as refused:
        await session.run_in_session(A(command="touch /tmp/ran\n(a"))
    assert {"bash_stdout", "bash_stderr"} <= set(refused.value.extra_info)
    assert (await session.run_in_session(A(command="test -e /tmp/ran", check="silent"))).exit_code == 1


async def test_timeout_keeps_partial_output_and_the_session(session):
    started = time.monotonic()
    with pytest.raises(CommandTimeoutError) as timed_out:
        await session.run_in_session(A(command="export KEPT=1; echo partial; sleep 30", timeout=1))
    assert time.monotonic() - started < 15
    assert timed_out.value.extra_info["output"] == "partial\n"
    # SWE-agent interrupts after a timeout; the command is already stopped, the session usable.
    interrupted = await session.run_in_session(BashInterruptAction())
    assert interrupted.exit_code == 0
    assert (await session.run_in_session(A(command="echo $KEPT"))).output == "1\n"


async def test_interactive_python_repl_through_expect(session):
    run = session.run_in_session
    await run(A(command="cd /tmp && export GREETING=hello"))
    started = await run(A(command="python3", is_interactive_command=True, expect=[">>> "], timeout=20))
    assert "Python 3" in started.output and started.expect_string == ">>> "
    printed = await run(
        A(command="import os; print(os.getcwd(), os.environ['GREETING'])", is_interactive_command=True, expect=[">>> "])
    )
    assert printed.output == "/tmp hello"
    # A regular expression, as pexpect takes SWE-ReX's patterns.
    counted = await run(A(command="print(6 * 7)", is_interactive_command=True, expect=[r"\d+\s+>>> "]))
    assert counted.expect_string == r"\d+\s+>>> "
    with pytest.raises(CommandTimeoutError) as timed_out:
        await run(
            A(
                command="print('no prompt'); import time; time.sleep(30)",
                is_interactive_command=True,
                expect=[">>> "],
                timeout=1,
            )
        )
    assert "no prompt" in timed_out.value.extra_info["output"]
    interrupted = await run(BashInterruptAction(expect=[">>> "], timeout=5))
    assert "KeyboardInterrupt" in interrupted.output and interrupted.expect_string == ">>> "
    quit_ = await run(A(command="quit()", is_interactive_quit=True, check="raise", timeout=10))
    assert quit_.exit_code == 0
    # Back at the session's prompt, with its state.
    assert (await run(A(command="pwd; echo $GREETING"))).output == "/tmp\nhello\n"


async def test_interrupt_kills_a_program_that_ignores_it(session):
    run = session.run_in_session
    await run(A(command="python3", is_interactive_command=True, expect=[">>> "], timeout=20))
    await run(
        A(
            command="import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)",
            is_interactive_command=True,
            expect=[">>> "],
        )
    )
    with pytest.raises(CommandTimeoutError):
        await run(A(command="while True: pass\n", is_interactive_command=True, expect=["never"], timeout=0.5))
    killed = await run(BashInterruptAction(timeout=0.3, n_retry=2))
    assert "killed" in killed.output.lower()
    assert (await run(A(command="echo back"))).output == "back\n"


async def test_execute(runtime):
    assert (await runtime.execute(Command(command="echo 'hello world'", shell=True))).stdout == "hello world\n"
    assert (await runtime.execute(Command(command=["echo", "-n", "\nx"]))).stdout == "\nx"
    split = await runtime.execute(Command(command=["bash", "-c", "echo out; echo err >&2; exit 3"]))
    assert (split.stdout, split.stderr, split.exit_code) == ("out\n", "err\n", 3)
    merged = await runtime.execute(Command(command=["bash", "-c", "echo out; echo err >&2"], merge_output_streams=True))
    assert (merged.stdout.splitlines(), merged.stderr) == (["out", "err"], "")
    where = await runtime.execute(Command(command="pwd; echo $ONE", shell=True, cwd="/tmp", env={"ONE": "1"}))
    assert where.stdout == "/tmp\n1\n"
    with pytest.raises(NonZeroExitCodeError, match="why: Command"):
        await runtime.execute(Command(command="exit 2", shell=True, check=True, error_msg="why"))
    with pytest.raises(CommandTimeoutError) as timed_out:
        await runtime.execute(Command(command="echo early; sleep 30", shell=True, timeout=1))
    assert timed_out.value.extra_info["stdout"] == "early\n"


async def test_files_go_to_exact_sandbox_paths(runtime, tmp_path: Path):
    await runtime.write_file(WriteFileRequest(path="/tmp/swerex/new/dir/file.txt", content="héllo\n"))
    assert (await runtime.read_file(ReadFileRequest(path="/tmp/swerex/new/dir/file.txt"))).content == "héllo\n"
    listed = await runtime.execute(Command(command="cat /tmp/swerex/new/dir/file.txt", shell=True))
    assert listed.stdout == "héllo\n"
    with pytest.raises(FileNotFoundError):
        await runtime.read_file(ReadFileRequest(path="/tmp/swerex/missing.txt"))

    source = tmp_path / "source.txt"
    source.write_text("uploaded")
    for target in ("/tmp/swerex/up/renamed.txt", "/tmp/swerex/up/source.txt"):
        await runtime.upload(UploadRequest(source_path=str(source), target_path=target))
        assert (await runtime.read_file(ReadFileRequest(path=target))).content == "uploaded"
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "a.txt").write_text("a")
    (tree / "sub" / "b.txt").write_text("b")
    await runtime.upload(UploadRequest(source_path=str(tree), target_path="/tmp/swerex/target_dir"))
    found = await runtime.execute(Command(command="cd /tmp/swerex/target_dir && find . -type f | sort", shell=True))
    assert found.stdout == "./a.txt\n./sub/b.txt\n"
    # Again onto the existing directory, with a file more: merged.
    (tree / "c.txt").write_text("c")
    await runtime.upload(UploadRequest(source_path=str(tree), target_path="/tmp/swerex/target_dir"))
    found = await runtime.execute(Command(command="cd /tmp/swerex/target_dir && find . -type f | sort", shell=True))
    assert found.stdout == "./a.txt\n./c.txt\n./sub/b.txt\n"


async def test_is_alive_and_close(runtime):
    assert await runtime.is_alive()
    await runtime.create_session(CreateBashSessionRequest(session="closing"))
    await runtime.close()
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(A(command="true", session="closing"))


async def test_deployment_labels_and_stop(local_daemon, backend):
    deployment = CorralDeployment(address=local_daemon.address, labels={"run": "t1"}, **SANDBOXES[backend])
    await deployment.start()
    sandbox_id = deployment.runtime.sandbox.id
    info = deployment.runtime.sandbox.info
    assert info.labels[HARNESS_LABEL] == HARNESS_NAME and info.labels["run"] == "t1"
    assert await deployment.is_alive()
    runtime = deployment.runtime
    await deployment.stop()
    await deployment.stop()  # a second stop does nothing
    assert not await runtime.is_alive()
    with Client(local_daemon.address) as client:
        assert sandbox_id not in {sandbox.id for sandbox in client.list_sandboxes()}


async def test_a_deployment_dropped_without_stop_destroys_its_sandbox(local_daemon, backend):
    """mini-swe-agent's SwerexDockerEnvironment never calls stop(): the sandbox must not live on
    until its idle timeout."""
    import gc

    deployment = CorralDeployment(address=local_daemon.address, **SANDBOXES[backend])
    await deployment.start()
    sandbox_id = deployment.runtime.sandbox.id
    del deployment
    gc.collect()
    with Client(local_daemon.address) as client:
        assert sandbox_id not in {sandbox.id for sandbox in client.list_sandboxes()}


async def test_remote_protocol_auth_and_exception_transfer(server):
    assert not await server.runtime(token="wrong").is_alive()
    remote = server.runtime()
    assert await remote.is_alive()
    with pytest.raises(SessionDoesNotExistError):
        await remote.run_in_session(A(command="true", session="nope"))
    async with aiohttp.ClientSession(server.url) as http:
        # SWE-ReX's server: 403 without the key, 401 with a wrong one, 422 for a body that is no request.
        async with http.get("/is_alive") as response:
            assert response.status == 403
        async with http.get("/is_alive", headers={"X-API-Key": "wrong"}) as response:
            assert response.status == 401
        async with http.post("/execute", json={"no": "command"}, headers={"X-API-Key": TOKEN}) as response:
            assert response.status == 422


async def test_remote_retry_with_the_same_request_id_runs_once(server):
    """A retried request (same X-Request-ID) gets the first answer again, as from SWE-ReX's server."""
    remote = server.runtime()
    await remote.create_session(CreateBashSessionRequest(session="counter"))
    headers = {"X-API-Key": TOKEN, "X-Request-ID": "retried-1"}
    action = A(command="n=$((${n:-0} + 1)); echo $n", session="counter").model_dump()
    async with aiohttp.ClientSession(server.url) as http:
        answers = []
        for _ in range(2):
            async with http.post("/run_in_session", json=action, headers=headers) as response:
                answers.append((await response.json())["output"])
    assert answers == ["1\n", "1\n"]
    assert (await remote.run_in_session(A(command="echo $n", session="counter"))).output == "1\n"
    await remote.close()


def test_server_destroys_its_sandbox_at_exit(local_daemon):
    server = start_swerex_server(local_daemon.address, *_sandbox_options("local"))
    with Client(local_daemon.address) as client:
        assert server.sandbox_id in {sandbox.id for sandbox in client.list_sandboxes()}
        assert server.stop() == 0
        assert server.sandbox_id not in {sandbox.id for sandbox in client.list_sandboxes()}


# SWE-agent's path, `deployment: remote` against `corral swerex-serve`, for a whole episode.

# The task: a repository with a bug and the test that shows it.
PARITY_REPO = {
    "parity.py": "def is_even(n):\n    return n % 2 == 1\n",
    "test_parity.py": (
        "import unittest\n\nfrom parity import is_even\n\n\n"
        "class ParityTest(unittest.TestCase):\n"
        "    def test_is_even(self):\n"
        "        self.assertTrue(is_even(4))\n"
        "        self.assertFalse(is_even(7))\n"
    ),
}
PARITY_TESTS = "python3 -B -m unittest -q test_parity"
# Tool bundles laid out as SWE-agent's (bin/ holds the commands the model calls), uploaded to
# /root/tools/<bundle>: an editor that replaces one exact occurrence in a file, and `submit`,
# which leaves the staged diff of the repository at /root/model.patch for the harness to read.
TOOL_BUNDLES = {
    "edit_replace/bin/str_replace": (
        "#!/usr/bin/env python3\n"
        "import sys\n"
        "path, old, new = sys.argv[1:4]\n"
        "text = open(path).read()\n"
        "if text.count(old) != 1:\n"
        "    sys.exit(f'{old!r} occurs {text.count(old)} times in {path}, not once')\n"
        "open(path, 'w').write(text.replace(old, new))\n"
        "print(f'{path} edited')\n"
    ),
    "submit/bin/submit": (
        '#!/bin/sh\ncd "$ROOT" && git add -A && git diff --cached > /root/model.patch\n'
        "echo '<<SWE_AGENT_SUBMISSION>>'\n"
    ),
}
SUBMISSION_MARKER = "<<SWE_AGENT_SUBMISSION>>"
# A scripted stand-in for SWE-agent's model: the actions it would answer with, in order.
SCRIPTED_ACTIONS = [
    PARITY_TESTS,
    "str_replace parity.py 'n % 2 == 1' 'n % 2 == 0'",
    PARITY_TESTS,
    "submit",
]


@dataclass
class SweAgentEpisode:
    observations: list[BashObservation]
    patch: str


def make_parity_repo(repo: Path) -> None:
    """The buggy repository, committed, at `repo` on the host."""
    repo.mkdir(parents=True)
    for name, text in PARITY_REPO.items():
        (repo / name).write_text(text)
    commit = "git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm buggy"
    subprocess.run(["sh", "-c", commit], cwd=repo, check=True)


async def swe_agent_episode(runtime: AbstractRuntime, workdir: Path) -> SweAgentEpisode:
    """One episode in the order SWE-agent's environment and tool handler drive SWE-ReX: a bash
    session sourcing /root/.bashrc, the repository and the tool bundles uploaded, the bundles'
    bin/ on PATH, the task's variables exported, `cd` to the repository; then each of the
    scripted model's actions as a session turn with a timeout (errors are observations, not
    exceptions), until `submit` says it is done and the patch is read back."""
    make_parity_repo(workdir / "repo")
    for name, text in TOOL_BUNDLES.items():
        (workdir / "tools" / name).parent.mkdir(parents=True, exist_ok=True)
        (workdir / "tools" / name).write_text(text)
    # The images SWE-agent runs have a /root/.bashrc; the test images have none.
    await runtime.write_file(WriteFileRequest(path="/root/.bashrc", content="export HISTFILE=/dev/null\n"))
    await runtime.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"], startup_timeout=30))
    await runtime.upload(UploadRequest(source_path=str(workdir / "repo"), target_path="/repo"))
    await asyncio.gather(
        *(
            runtime.upload(UploadRequest(source_path=str(bundle), target_path=f"/root/tools/{bundle.name}"))
            for bundle in (workdir / "tools").iterdir()
        )
    )

    async def communicate(command: str, check: Literal["silent", "raise"] = "raise") -> BashObservation:
        return await runtime.run_in_session(A(command=command, timeout=30, check=check))

    await communicate("export ROOT=/repo PAGER=cat GIT_PAGER=cat LANG=C.UTF-8")
    for bundle in sorted((workdir / "tools").iterdir()):
        await communicate(
            f"export PATH=/root/tools/{bundle.name}/bin:$PATH && chmod +x /root/tools/{bundle.name}/bin/*"
        )
    await communicate("cd /repo && git status --short && git reset -q --hard && git clean -fdq")
    observations = []
    for action in SCRIPTED_ACTIONS:
        observations.append(await communicate(action, check="silent"))
        if SUBMISSION_MARKER in observations[-1].output:
            break
    patch = (await runtime.read_file(ReadFileRequest(path="/root/model.patch"))).content
    return SweAgentEpisode(observations, patch)


async def test_swe_agent_path_fixes_a_bug_and_submits_the_diff(server, tmp_path: Path):
    """SWE-ReX's RemoteRuntime, as SWE-agent's `deployment: remote` uses it, against `corral
    swerex-serve`: the failing test, the fix through an uploaded tool, the passing test, and the
    submitted patch fixing a fresh copy of the repository on the host."""
    remote = server.runtime()
    try:
        episode = await swe_agent_episode(remote, tmp_path / "episode")
    finally:
        await remote.close()
    before, edited, after, submitted = episode.observations
    assert before.exit_code == 1 and "FAILED" in before.output
    assert edited.exit_code == 0 and edited.output == "parity.py edited\n"
    assert after.exit_code == 0 and "OK" in after.output
    assert submitted.exit_code == 0 and SUBMISSION_MARKER in submitted.output
    # The fix, and only the fix.
    diffs = [line for line in episode.patch.splitlines() if line.startswith("diff ")]
    assert diffs == ["diff --git a/parity.py b/parity.py"]
    assert "-    return n % 2 == 1\n+    return n % 2 == 0\n" in episode.patch
    fresh = tmp_path / "fresh"
    make_parity_repo(fresh)
    tests = [sys.executable, "-B", "-m", "unittest", "-q", "test_parity"]
    assert subprocess.run(tests, cwd=fresh, capture_output=True).returncode == 1
    subprocess.run(["git", "apply", "-"], input=episode.patch.encode(), cwd=fresh, check=True)
    assert subprocess.run(tests, cwd=fresh, capture_output=True).returncode == 0


def _sandbox_options(backend: str) -> list[str]:
    return ["--backend", SANDBOXES[backend]["backend"], "--image", SANDBOXES[backend]["image"]]


@pytest.fixture(scope="module")
def swerex_tests(tmp_path_factory) -> Path:
    """SWE-ReX's tests/ directory: CORRAL_SWEREX_TESTS, or with "pypi" the one in the source
    distribution of the installed swe-rex, downloaded (its wheel has no tests)."""
    if SWEREX_TESTS != "pypi":
        return Path(SWEREX_TESTS)
    import swerex

    into = tmp_path_factory.mktemp("swe-rex-sdist")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        + [f"swe-rex=={swerex.__version__}", "-d", str(into)],
        check=True,
        timeout=300,
    )
    (archive,) = into.glob("swe_rex-*.tar.gz")
    with tarfile.open(archive) as sdist:
        sdist.extractall(into, filter="data")
    return into / archive.name.removesuffix(".tar.gz") / "tests"


@pytest.mark.skipif(not SWEREX_TESTS, reason="CORRAL_SWEREX_TESTS (SWE-ReX's tests/ directory) is not set")
@pytest.mark.parametrize("via", ["remote", "corral"])
def test_swe_rex_own_test_modules(local_daemon, backend, via, swerex_tests, tmp_path):
    """SWE-ReX's test modules, unchanged, with their conftest's fixtures on corral."""
    package = tmp_path / "tests"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "conftest.py").write_text("from swerex_plugin import *  # noqa: F403\n")
    for name in SWEREX_TEST_MODULES:
        (package / name).symlink_to((swerex_tests / name).resolve())
    report = tmp_path / "junit.xml"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(report)]
        + ["-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=function", "tests"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": str(Path(__file__).parent),
            "CORRAL_ADDRESS": local_daemon.address,
            "CORRAL_SWEREX_BACKEND": SANDBOXES[backend]["backend"],
            "CORRAL_SWEREX_IMAGE": SANDBOXES[backend]["image"],
            "CORRAL_SWEREX_VIA": via,
        },
    )
    cases = list(ElementTree.parse(report).iter("testcase"))
    failed = sorted(
        case.get("name", "") for case in cases if case.find("failure") is not None or case.find("error") is not None
    )
    skipped = [case for case in cases if case.find("skipped") is not None]
    print(f"SWE-ReX's tests on {backend}/{via}: {len(cases)} run, {len(failed)} failed, {len(skipped)} skipped")
    print("\n".join(f"  failed: {name} ({SWEREX_HOST_TESTS.get(name, 'unexpected')})" for name in failed))
    assert len(cases) > 40, run.stdout[-5000:]  # the modules were found and collected
    unexpected = [name for name in failed if name not in SWEREX_HOST_TESTS]
    assert not unexpected, run.stdout[-5000:]
