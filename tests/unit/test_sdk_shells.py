"""Shell sessions through the SDK (`Sandbox.shell`, `Shell`, their asyncio twins) and the
interactive `corral shell ID`: the SDK's wrappers and the daemon's sessions above the backend, on
the fake backend (a daemon in a thread of this process; its shells are bash on the host, as the
caller). What differs per backend is tests/integration/test_shells.py's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from corral.sdk import AsyncClient, CommandExitError, InvalidArgument, NotFound, ShellInfo, ShellResult

CLI = [sys.executable, "-m", "corral.cli"]


def test_run_keeps_state_across_runs(sandbox):
    shell = sandbox.shell()
    assert shell.name == "main" and shell.sandbox_id == sandbox.id
    assert isinstance(shell.info, ShellInfo) and shell.info.turns == 0 and shell.info.pid > 0
    first = shell.run('cd /tmp && export GREETING=hello && f() { echo "f:$1"; }')
    assert first.ok and first.output == b""
    result = shell.run("pwd; echo $GREETING; f x")
    assert isinstance(result, ShellResult)
    assert result.output == b"/tmp\nhello\nf:x\n" and result.text == "/tmp\nhello\nf:x\n"
    assert (result.exit_code, result.timed_out, result.timeout_reason) == (0, False, None)
    assert not result.truncated and result.output_total_bytes == len(result.output)
    assert not result.shell_restarted and result.output_plain is None
    assert shell.refresh().turns == 2


def test_exit_codes_and_check(sandbox):
    shell = sandbox.shell()
    failed = shell.run("(exit 7)")
    assert failed.exit_code == 7 and not failed.ok
    with pytest.raises(CommandExitError) as caught:
        shell.run("echo oops; false", check=True)
    assert caught.value.result.exit_code == 1 and caught.value.result.output == b"oops\n"
    assert "exited with code 1" in str(caught.value) and "oops" in str(caught.value)
    assert shell.run("true", check=True).ok
    with pytest.raises(CommandExitError):
        failed.check()


def test_timeouts_interrupt_and_keep_the_session(sandbox):
    shell = sandbox.shell()
    shell.run("KEPT=yes")
    slow = shell.run("echo start; sleep 30", timeout=1)
    assert slow.timed_out and slow.timeout_reason == "timeout" and slow.output.startswith(b"start")
    assert not slow.ok and slow.exit_code != 0
    quiet = shell.run("echo a; sleep 30", timeout=20, idle_timeout=0.5)
    assert quiet.timed_out and quiet.timeout_reason == "idle_timeout" and quiet.duration_ms < 15_000
    with pytest.raises(CommandExitError, match="idle timeout"):
        quiet.check()
    after = shell.run("echo $KEPT")
    assert after.output == b"yes\n" and not after.shell_restarted


def test_strip_ansi_and_output_limit(sandbox):
    shell = sandbox.shell()
    coloured = shell.run(r"printf '\033[1;31mred\033[0m plain\n'", strip_ansi=True)
    assert coloured.output == b"\x1b[1;31mred\x1b[0m plain\n" and coloured.output_plain == b"red plain\n"
    big = shell.run("head -c 100000 /dev/zero | tr '\\0' a", output_limit=1000)
    assert big.truncated and big.output_total_bytes == 100_000 and len(big.output) <= 1000


def test_same_name_is_the_same_session(sandbox):
    main = sandbox.shell("main")
    main.run("cd /tmp; V=1")
    # The session exists, so this attaches to it; the options of an existing session stay as opened.
    again = sandbox.shell("main", cwd="/", env={"V": "2"})
    assert again.info.pid == main.info.pid
    assert again.run("echo $V; pwd").output == b"1\n/tmp\n"
    assert [s.name for s in sandbox.list_shells()] == ["main"]


def test_named_sessions_list_and_close(sandbox):
    main = sandbox.shell()
    main.run("V=main")
    other = sandbox.shell("other", env={"ONLY": "here"}, cwd="/tmp", rows=30, cols=100)
    assert other.run("echo ${V:-unset} $ONLY; pwd; stty size").output == b"unset here\n/tmp\n30 100\n"
    assert main.run("pwd").output == f"{sandbox.info.workdir}\n".encode()
    shells = {s.name: s for s in sandbox.list_shells()}
    assert sorted(shells) == ["main", "other"] and shells["other"].sandbox_id == sandbox.id
    assert shells["main"].turns == 2

    handle = sandbox.shell("other", open=False)
    assert handle.info is None and handle.refresh().pid == other.info.pid
    other.close()
    other.close()  # closing twice, or a session that is gone, is not an error
    handle.close()
    assert [s.name for s in sandbox.list_shells()] == ["main"]
    with pytest.raises(NotFound):
        handle.run("true")
    with pytest.raises(NotFound):
        handle.refresh()

    with sandbox.shell("scoped") as scoped:
        assert scoped.run("echo in").output == b"in\n"
    assert "scoped" not in [s.name for s in sandbox.list_shells()]


def test_arguments_are_checked_before_sending(sandbox):
    shell = sandbox.shell()
    with pytest.raises(InvalidArgument):
        shell.run(b"echo bytes")  # bytes, not str
    with pytest.raises(InvalidArgument):
        shell.run("true", timeout=0)
    with pytest.raises(InvalidArgument):
        sandbox.shell("half-sized", rows=10)
    with pytest.raises(NotFound):
        sandbox.shell("never-opened", open=False).run("true")


async def test_async_shell(address):
    async with AsyncClient(address) as client:
        async with await client.create_sandbox() as sandbox:
            shell = await sandbox.shell()
            await shell.run("cd /tmp; N=3")
            result = await shell.run("echo $N; pwd")
            assert result.output == b"3\n/tmp\n" and result.ok
            same = await sandbox.shell("main")
            assert (await same.run("echo $N")).output == b"3\n"
            with pytest.raises(CommandExitError):
                await shell.run("false", check=True)
            plain = await shell.run(r"printf '\033[32mgreen\033[0m'", strip_ansi=True)
            assert plain.output_plain == b"green"
            async with await sandbox.shell("second") as second:
                assert (await second.run("echo ${N:-unset}")).output == b"unset\n"
                assert sorted(s.name for s in await sandbox.list_shells()) == ["main", "second"]
            assert [s.name for s in await sandbox.list_shells()] == ["main"]
            await shell.close()
            assert await sandbox.list_shells() == []
            handle = await sandbox.shell("main", open=False)
            with pytest.raises(NotFound):
                await handle.run("true")


def _cli_shell(address: str, *args: str, stdin: bytes) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}, "CORRAL_ADDRESS": address}
    return subprocess.run([*CLI, "shell", *args], input=stdin, capture_output=True, env=env, timeout=60)


def test_cli_shell_with_piped_stdin(address, sandbox):
    done = _cli_shell(address, sandbox.id, stdin=b"echo hi; exit 3\n")
    assert done.returncode == 3, done.stderr
    assert b"hi\r\n" in done.stdout  # an interactive terminal: the usual CRLF output
    # Without an `exit`, the end of stdin ends the shell, which exits with its last status.
    ended = _cli_shell(address, sandbox.id, stdin=b"echo $((6 * 7))\nsleep 0.5; (exit 5)\n")
    assert ended.returncode == 5 and b"42\r\n" in ended.stdout
    # Only the program is checked here: dash's exit status in a terminal whose foreground process
    # group came from outside a sandbox's pid namespace is not the one it was given.
    sh = _cli_shell(address, sandbox.id, "--program", "sh", stdin=b"echo prog=$0; exit 4\n")
    assert b"prog=sh" in sh.stdout
    # The terminal is its own shell, not one of the named sessions.
    assert sandbox.list_shells() == []


def test_cli_shell_unknown_sandbox(address):
    missing = _cli_shell(address, "sb-does-not-exist", stdin=b"exit 0\n")
    assert missing.returncode == 1 and b"corral shell:" in missing.stderr


# ---- the sans-IO part, without a daemon ----------------------------------------------------------


def test_shell_deadline_and_decoding():
    from corral.sdk._core import (
        SHELL_DEADLINE_MARGIN_S,
        build_run_in_shell_request,
        shell_deadline,
        shell_result_from_proto,
    )
    from corral.v1 import shell_pb2

    # The daemon's interrupt sequence (SIGINT, EOF, SIGKILL) must fit before the client gives up.
    assert shell_deadline(60.0) == 60.0 + SHELL_DEADLINE_MARGIN_S and SHELL_DEADLINE_MARGIN_S >= 10
    request = build_run_in_shell_request(
        "sb-1", "main", "ls", timeout=0.0001, idle_timeout=2, output_limit=None, strip_ansi=True
    )
    assert (request.timeout_ms, request.idle_timeout_ms, request.strip_ansi) == (1, 2000, True)
    plain = shell_result_from_proto(shell_pb2.RunInShellResponse(output=b"x", output_plain=b""))
    assert plain.output_plain == b"" and plain.timeout_reason is None
    newer = shell_result_from_proto(shell_pb2.RunInShellResponse(timed_out=True, timeout_reason="cpu"))
    assert newer.timeout_reason == "timeout"


def test_a_missing_working_directory_is_named_before_anything_starts(sandbox):
    """A shell, a background process or a kernel asked to start in a directory the sandbox lacks
    fails with FAILED_PRECONDITION naming it (not "the shell exited at once (exit 126)")."""
    from corral.sdk import FailedPrecondition

    missing = sandbox.info.workdir.rstrip("/") + "/no/such/dir"
    with pytest.raises(FailedPrecondition, match=f"cwd {missing} does not exist in sandbox {sandbox.id}"):
        sandbox.shell("elsewhere", cwd=missing)
    with pytest.raises(FailedPrecondition, match=f"cwd {missing} does not exist"):
        sandbox.start_process(["true"], cwd=missing)
    with pytest.raises(FailedPrecondition, match=f"cwd {missing} does not exist"):
        sandbox.kernel(cwd=missing)
    assert [s.name for s in sandbox.list_shells()] == []  # nothing was left half-started
    existing = sandbox.shell("here", cwd=sandbox.info.workdir).run("pwd")
    assert existing.text.strip() == sandbox.info.workdir
