"""Exec and ExecStream against a real daemon: what a command sees and how it ends on every backend
case; output caps, event order and request checks, above the backend, on one (tests/README.md)."""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from corral.sdk import errors


def test_exit_codes_and_output(sandbox):
    r = sandbox.exec("echo out; echo err >&2; exit 7", timeout=10)
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (7, b"out\n", b"err\n", False, False)
    assert sandbox.exec(["true"], timeout=10).exit_code == 0


def test_signal_is_reported(sandbox):
    r = sandbox.exec("kill -TERM $$", timeout=10)
    assert r.signal == 15 and r.exit_code == 128 + 15


def test_stdin_given_and_default_eof(sandbox):
    assert sandbox.exec(["cat"], stdin=b"abc\x00\xff", timeout=10).stdout == b"abc\x00\xff"
    # No stdin: a reader sees EOF at once instead of hanging until the timeout.
    r = sandbox.exec(["cat"], timeout=10)
    assert r.exit_code == 0 and r.stdout == b"" and not r.timed_out


def test_env_and_cwd(sandbox):
    sandbox.exec("mkdir -p /workspace/sub", timeout=10).check()
    r = sandbox.exec("echo $FOO; pwd", env={"FOO": "bar baz"}, cwd="/workspace/sub", timeout=10)
    assert r.stdout == b"bar baz\n/workspace/sub\n"
    assert sandbox.exec(["pwd"], timeout=10).stdout == b"/workspace\n"


def test_binary_output_is_bytes_end_to_end(sandbox):
    r = sandbox.exec(r"printf '\377\376\000\200abc'", timeout=10)
    assert r.stdout == b"\xff\xfe\x00\x80abc"


@pytest.mark.above_backend
def test_huge_output_keeps_head_and_tail(sandbox):
    # 50 MB of numbered lines: the first and the last lines must both survive the cap.
    r = sandbox.exec("seq 1 6000000", timeout=60, output_limit=1 << 20)
    assert r.truncated and r.exit_code == 0
    assert r.stdout_total_bytes > 45_000_000
    assert len(r.stdout) == 1 << 20
    assert r.stdout.startswith(b"1\n2\n3\n")
    assert r.stdout.endswith(b"5999999\n6000000\n")


def test_timeout_kills_whole_tree(sandbox):
    # Three processes, one of which escapes the process group with setsid.
    start = time.monotonic()
    r = sandbox.exec("sleep 300 & setsid sleep 301 & echo started; sleep 302", timeout=1)
    assert r.timed_out and r.signal == 9
    assert r.stdout == b"started\n"  # the output so far comes back
    assert time.monotonic() - start < 10
    ps = sandbox.exec("ps -eo args", timeout=10).stdout.decode()
    assert "sleep 30" not in ps, ps


def test_background_child_does_not_hold_the_call(sandbox):
    start = time.monotonic()
    r = sandbox.exec("sleep 100 & echo bg", timeout=60)
    assert r.stdout == b"bg\n" and r.exit_code == 0
    assert time.monotonic() - start < 5


@pytest.mark.above_backend
def test_exec_stream_event_order(sandbox):
    events = list(
        sandbox.exec_stream("for i in 1 2 3; do echo $i; sleep 0.3; done; echo e >&2", timeout=30, keepalive=0.1)
    )
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "ExecStarted" and kinds[-1] == "ExecExited"
    assert "ExecKeepalive" in kinds
    out = b"".join(e.data for e in events if type(e).__name__ == "ExecOutput" and e.stream == "stdout")
    err = b"".join(e.data for e in events if type(e).__name__ == "ExecOutput" and e.stream == "stderr")
    assert (out, err) == (b"1\n2\n3\n", b"e\n")
    assert events[-1].exit_code == 0


def test_exec_stream_cancel_kills_command(sandbox):
    stream = sandbox.exec_stream("echo ready; sleep 600", timeout=700)
    for event in stream:
        if type(event).__name__ == "ExecOutput":
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if "sleep 600" not in sandbox.exec("ps -eo args", timeout=10).stdout.decode():
            return
        time.sleep(0.1)
    pytest.fail("the streamed command survived its cancelled call")


@pytest.mark.above_backend
def test_bad_input(client, sandbox):
    with pytest.raises(errors.SandboxNotFound):
        client.get_sandbox("sb-doesnotexist")
    with pytest.raises(errors.InvalidArgument):
        sandbox.exec([], timeout=10)
    with pytest.raises(errors.InvalidArgument):
        sandbox.exec(["true"], timeout=10**9)


@pytest.mark.above_backend
def test_cwd_relative_to_the_workdir_and_missing_cwd_is_a_clear_error(sandbox):
    """A relative cwd resolves against the workdir, as file paths do; a missing one is
    FAILED_PRECONDITION naming the path (it used to be exit 126 from the `cd` wrapper)."""
    sandbox.exec("mkdir -p /workspace/rel/dir", timeout=10, check=True)
    assert sandbox.exec(["pwd"], cwd="rel/dir", timeout=10).stdout == b"/workspace/rel/dir\n"
    with pytest.raises(errors.FailedPrecondition, match="cwd /workspace/missing does not exist"):
        sandbox.exec(["pwd"], cwd="missing", timeout=10)
    with pytest.raises(errors.FailedPrecondition, match="cwd /no/such/dir does not exist"):
        list(sandbox.exec_stream(["pwd"], cwd="/no/such/dir", timeout=10))


@pytest.mark.above_backend
def test_missing_program_gives_a_nonzero_exit(sandbox):
    r = sandbox.exec(["no-such-program-xyz"], timeout=10)
    assert r.exit_code != 0 and b"no-such-program-xyz" in r.stderr


@pytest.mark.load
def test_200_concurrent_execs_over_20_sandboxes(client):
    sandboxes = [client.create_sandbox() for _ in range(20)]
    try:

        def run(i: int) -> tuple[int, bytes]:
            sb = sandboxes[i % 20]
            return i, sb.exec(["echo", f"{i}-{i * 2}"], timeout=60).stdout

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(run, range(200)))
        assert all(out == f"{i}-{i * 2}\n".encode() for i, out in results)
    finally:
        for sb in sandboxes:
            sb.destroy()


@pytest.mark.above_backend
async def test_async_client_against_the_daemon(daemon):
    from corral.sdk import AsyncClient

    async with AsyncClient(daemon.address) as client:
        async with await client.create_sandbox() as sb:
            r = await sb.exec("echo async; exit 2", timeout=10)
            assert (r.exit_code, r.stdout) == (2, b"async\n")
            kinds = [type(e).__name__ async for e in sb.exec_stream(["echo", "x"], timeout=10)]
            assert kinds[0] == "ExecStarted" and kinds[-1] == "ExecExited"
            await sb.write_file("a.txt", b"async file")
            assert await sb.read_file("a.txt") == b"async file"
            sandbox_id = sb.id
        assert sandbox_id not in [s.id for s in await client.list_sandboxes()]


def test_caller_environment_never_reaches_host_side_helpers(sandbox):
    """The host-side steps that enter a sandbox run as root: LD_PRELOAD & co. must stay inside."""
    stream = sandbox.exec_stream("echo $CORRAL_PROBE; sleep 5", env={"CORRAL_PROBE": "inside-only"}, timeout=30)
    with stream:
        pid = None
        for event in stream:
            if type(event).__name__ == "ExecStarted":
                pid = event.pid
            if type(event).__name__ == "ExecOutput":
                assert event.data == b"inside-only\n"
                break
        host_environ = open(f"/proc/{pid}/environ", "rb").read()
        assert b"CORRAL_PROBE" not in host_environ
